package regserver

import (
	"context"
	"net"
	"os"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/net/http2"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"multireg.dev/multireg/internal/testkit"
)

// TestAConnectionWithoutACallIsClosed: a connection that sends the HTTP/2 preface and nothing
// else is closed once firstCallTimeout has passed, and kubelet's connections are served meanwhile.
func TestAConnectionWithoutACallIsClosed(t *testing.T) {
	_, gs := serveTestWith(t, 1, func(l *limits) { l.firstCallTimeout = 300 * time.Millisecond })
	p := dialH2(t, gs[0].path)
	testkit.Register(t, gs[0].path, testkit.Kubelet136, true, "")
	if !p.closedWithin(10 * time.Second) {
		t.Fatal("a connection without a call still open 10 s after it was accepted")
	}
}

// TestAConnectionThatNeverSpeaksIsForgotten: a connection that never sends the HTTP/2 preface
// (gRPC reports nothing of a handshake that never ends) is closed once firstCallTimeout has
// passed, and forgotten with it: the socket's server, with no other connection, is let go.
func TestAConnectionThatNeverSpeaksIsForgotten(t *testing.T) {
	_, gs := serveTestWith(t, 1, func(l *limits) { l.firstCallTimeout = 300 * time.Millisecond })
	g := gs[0]
	c, err := net.Dial("unix", g.path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if p := (&h2{t: t, c: c}); !p.closedWithin(10 * time.Second) {
		t.Fatal("a silent connection still open 10 s after it was accepted")
	}
	testkit.Eventually(t, 5*time.Second, "the idle socket's server let go", func() bool {
		g.mu.Lock()
		defer g.mu.Unlock()
		return len(g.opening) == 0 && g.srv == nil
	})
}

// TestAnUnfinishedRequestIsCut: a request that declares more than maxRequest is refused at
// once; one within it that never arrives whole is cut once callTimeout has passed from its
// headers. The connection goes on serving.
func TestAnUnfinishedRequestIsCut(t *testing.T) {
	_, gs := serveTestWith(t, 1, func(l *limits) { l.callTimeout = 500 * time.Millisecond })
	p := dialH2(t, gs[0].path)
	p.call(1, "NotifyRegistrationStatus")
	p.body(1, 1<<20, 16<<10)
	if st, closed := p.ended(1, 5*time.Second); closed || st != "8" {
		t.Errorf("a request declaring 1 MiB: grpc-status %q (connection closed: %v), want 8 (ResourceExhausted)", st, closed)
	}
	p.call(3, "NotifyRegistrationStatus")
	p.body(3, maxRequest/2, maxRequest/4)
	start := time.Now()
	st, closed := p.ended(3, 10*time.Second)
	if closed || st == "0" {
		t.Errorf("an unfinished request: grpc-status %q (connection closed: %v), want the call ended with an error", st, closed)
	}
	if d := time.Since(start); d < 400*time.Millisecond {
		t.Errorf("an unfinished request cut after %s, before callTimeout", d)
	}
	testkit.Register(t, gs[0].path, testkit.Kubelet136, true, "")
}

// TestConnectionsToASocketAreBounded: a socket holds maxConnsPerSocket connections at most; a
// new one takes the place of the one idle the longest, so kubelet's new connection is served
// while the others flood.
func TestConnectionsToASocketAreBounded(t *testing.T) {
	h, gs := serveTest(t, 1)
	perSocket := h.lim.maxConnsPerSocket
	var ps []*h2
	for range 3 * perSocket {
		ps = append(ps, dialH2(t, gs[0].path))
	}
	testkit.Register(t, gs[0].path, testkit.Kubelet136, true, "")
	open := 0
	for _, p := range ps {
		if !p.closedWithin(100 * time.Millisecond) {
			open++
		}
	}
	if open > perSocket {
		t.Errorf("%d of the flood's %d connections still open, want at most %d", open, len(ps), perSocket)
	}
	h.mu.Lock()
	n := len(h.conns)
	h.mu.Unlock()
	if n > perSocket {
		t.Errorf("the hub counts %d connections, want at most %d", n, perSocket)
	}
}

// TestASocketKeepsItsReserve: with the process's connections at their limit (maxConns and one
// per socket), a socket with none still admits kubelet's.
func TestASocketKeepsItsReserve(t *testing.T) {
	_, gs := serveTestWith(t, 4, func(l *limits) { l.maxConns = 2 }) // and 4 sockets: 6
	for i := range 3 {
		for range 2 {
			p := dialH2(t, gs[i].path)
			p.call(1, "GetInfo")
			p.fr.WriteData(1, true, make([]byte, 5))
			if st, closed := p.ended(1, 5*time.Second); closed || st != "0" {
				t.Fatalf("a flood's GetInfo: grpc-status %q (closed %v)", st, closed)
			}
		}
	}
	// Six connections that made a call: the process is at its limit, and none is evicted.
	c, err := net.Dial("unix", gs[0].path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	_, err = c.Write([]byte(http2.ClientPreface)) // fails if it was closed already
	if p := (&h2{t: t, c: c}); err == nil && !p.closedWithin(5*time.Second) {
		t.Error("a seventh connection admitted beyond the limit")
	}
	testkit.Register(t, gs[3].path, testkit.Kubelet136, true, "")
}

// TestStalledCallsMakeRoom: beyond the calls allowed in flight (maxCalls and one per socket), a
// new call cuts the oldest stalled one, so kubelet's GetInfo is answered while unfinished
// requests pile up.
func TestStalledCallsMakeRoom(t *testing.T) {
	h, gs := serveTestWith(t, 3, func(l *limits) { l.maxCalls = 1 }) // and 3 sockets: 4
	var ps []*h2
	for i := range 10 {
		p := dialH2(t, gs[i%3].path) // within maxConnsPerSocket, kubelet's included
		p.call(1, "NotifyRegistrationStatus")
		p.body(1, 32<<10, 100)
		ps = append(ps, p)
	}
	// kubelet's calls come after the flood's: every flood call admitted (and cut, beyond the
	// limit) first. Otherwise, on a loaded machine, flood calls admitted after kubelet's
	// Notify cut it in turn, once it is the oldest in flight.
	testkit.Eventually(t, 10*time.Second, "every flood call admitted", func() bool {
		h.mu.Lock()
		defer h.mu.Unlock()
		began := 0
		for _, u := range h.conns {
			if u.began {
				began++
			}
		}
		return began == len(ps)
	})
	testkit.Register(t, gs[1].path, testkit.Kubelet136, true, "")
	cut := 0
	for _, p := range ps {
		if st, closed, ok := p.endedWithin(1, 500*time.Millisecond); ok && !closed && st != "0" {
			cut++
		}
	}
	if cut < 6 {
		t.Errorf("%d of 10 unfinished calls cut or refused, want at least 6 (4 calls in flight at most)", cut)
	}
	h.mu.Lock()
	n := len(h.calls)
	h.mu.Unlock()
	if n > 4 {
		t.Errorf("%d calls in flight, want at most 4", n)
	}
}

// TestAnAcceptTakesOneDescriptor: with a single descriptor left for the server, kubelet's
// connection is accepted and served (net.FileConn's duplicate needed two, and its failure
// closed the connection just accepted).
func TestAnAcceptTakesOneDescriptor(t *testing.T) {
	_, gs := serveTest(t, 1)
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Setrlimit(syscall.RLIMIT_NOFILE, &rl) })
	c, err := net.Dial("unix", gs[0].path) // kubelet's end
	if err != nil {
		t.Fatal(err)
	}
	// The lowest free descriptor + 1: one left, for the server's end.
	f, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	next := f.Fd()
	f.Close()
	low := rl
	low.Cur = uint64(next) + 1
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &low); err != nil {
		t.Fatal(err)
	}
	p := newH2(t, c)
	p.call(1, "GetInfo")
	if err := p.fr.WriteData(1, true, make([]byte, 5)); err != nil {
		t.Fatal(err)
	}
	if st, closed := p.ended(1, 10*time.Second); closed || st != "0" {
		t.Errorf("GetInfo with one descriptor left: grpc-status %q (connection closed: %v), want 0", st, closed)
	}
}

// TestKubeletsConnectionOutlastsAFlood: kubelet's connection, between its GetInfo and its
// verdict, is the last a flood of new connections to its socket closes: the verdict arrives.
func TestKubeletsConnectionOutlastsAFlood(t *testing.T) {
	g, k, verdicts := askedSocket(t)
	for range 3 * defaultLimits().maxConnsPerSocket {
		p := dialH2(t, g.path)
		p.call(1, "NotifyRegistrationStatus")
		p.fr.WriteData(1, true, make([]byte, 5))
		p.ended(1, 5*time.Second)
	}
	k.Notify(t, true, "")
	select {
	case v := <-verdicts:
		if !v.Registered {
			t.Errorf("verdict %+v, want registered", v)
		}
	default:
		t.Error("kubelet's verdict did not count: its connection was closed for the flood's")
	}
}

// TestStopForgetsConnectionsInTheHandshake: a connection whose handshake a stop cut short no
// longer counts against the bounds (no ConnEnd comes for it).
func TestStopForgetsConnectionsInTheHandshake(t *testing.T) {
	h, gs := serveTest(t, 1)
	c, err := net.Dial("unix", gs[0].path) // no preface: its handshake waits
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	count := func() int {
		h.mu.Lock()
		defer h.mu.Unlock()
		return len(h.conns)
	}
	testkit.Eventually(t, 5*time.Second, "the connection admitted", func() bool { return count() == 1 })
	gs[0].Stop()
	// Well before firstCallTimeout, which would forget it too.
	testkit.Eventually(t, 2*time.Second, "the connection forgotten after the stop", func() bool { return count() == 0 })
}

// TestKubeletsBurstIsNeverCut: kubelet registering every socket at once holds a connection to
// each, with a call on each: however few connections and calls the bounds allow beyond one
// per socket, none of kubelet's is refused or cut.
func TestKubeletsBurstIsNeverCut(t *testing.T) {
	one := func(l *limits) { l.maxConns, l.maxCalls = 1, 1 }
	const n = 24
	_, gs := serveTestWith(t, n, one)
	ks := make([]*testkit.Kubelet, n)
	for i, g := range gs {
		ks[i] = dialKubelet(t, g.path)
	}
	errs := make(chan error, n)
	var wg sync.WaitGroup
	for _, k := range ks { // every GetInfo at once, each connection kept open
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_, err := k.C.GetInfo(ctx, &registerapi.InfoRequest{})
			errs <- err
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Errorf("kubelet's GetInfo in a burst of %d: %v", n, err)
		}
	}
	for _, k := range ks { // then every verdict, on the same connections
		k.Notify(t, true, "")
	}
}

// stall starts, on a new connection to path, a call whose request declares maxRequest/2 bytes
// and never arrives whole, and waits until the hub has admitted the call.
func stall(t *testing.T, h *Hub, path string) *h2 {
	t.Helper()
	before := connIDs.Load()
	p := dialH2(t, path)
	p.call(1, "NotifyRegistrationStatus")
	p.body(1, maxRequest/2, 100)
	waitCall(t, h, before)
	return p
}

// waitCall waits until a call began on a connection h admitted after connection number before.
func waitCall(t *testing.T, h *Hub, before uint64) {
	t.Helper()
	testkit.Eventually(t, 10*time.Second, "the call admitted", func() bool {
		h.mu.Lock()
		defer h.mu.Unlock()
		for cn, u := range h.conns {
			if cn.id > before && u.began {
				return true
			}
		}
		return false
	})
}

// TestKubeletsVerdictOutlastsStalledCalls: kubelet's NotifyRegistrationStatus, its request
// arrived whole and its handler under way (held here, to widen that moment), is not cut by
// stalled calls arriving meanwhile beyond the bound, on its socket and on another: the flood's
// own stalled calls are cut instead, and kubelet's connection, its call in flight, is not
// closed for the flood's next connection to its socket. The verdict is answered OK and counts.
//
// The oldest call in flight used to be cut, kubelet's: grpc-go no longer watches a call's
// context once its handler runs, so the reply would still have gone out, but the hub had
// forgotten the call, and its connection, idle to the hub, was the one the flood's next
// connection to the socket closed: kubelet's verdict failed with UNAVAILABLE.
func TestKubeletsVerdictOutlastsStalledCalls(t *testing.T) {
	h, gs := serveTestWith(t, 2, func(l *limits) { l.maxCalls = 1 }) // and 2 sockets: 3 calls
	g := gs[0]
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	free := func() { once.Do(func() { close(release) }) }
	t.Cleanup(free)
	verdicts := make(chan Verdict, 1)
	g.rs.notify = func(v Verdict) {
		close(entered)
		<-release
		verdicts <- v
	}
	k := dialKubelet(t, g.path)
	k.GetInfo(t)
	notified := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := k.C.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: true})
		notified <- err
	}()
	select {
	case <-entered:
	case <-time.After(10 * time.Second):
		t.Fatal("kubelet's verdict never reached its handler")
	}
	testkit.Eventually(t, 5*time.Second, "kubelet's GetInfo ended, its verdict in flight", func() bool {
		h.mu.Lock()
		defer h.mu.Unlock()
		return len(h.calls) == 1
	})
	var ps []*h2
	// Three stalled calls on kubelet's socket, beyond the bound with kubelet's: the socket holds
	// maxConnsPerSocket connections.
	for range 3 {
		ps = append(ps, stall(t, h, g.path))
	}
	// The flood's next connection to kubelet's socket: refused (every connection has a call in
	// flight), or admitted in the place of one idle to the hub.
	c, err := net.Dial("unix", g.path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	_, _ = c.Write([]byte(http2.ClientPreface)) // fails if it was closed already
	// More stalled calls, on the other socket: twice the bound in all.
	for range 3 {
		ps = append(ps, stall(t, h, gs[1].path))
	}
	// What the hub counts: kubelet's connection (the one that asked GetInfo) and its call, and
	// the flood's calls in flight, within the bound.
	h.mu.Lock()
	var conns, calls, flood int
	for cn := range h.conns {
		if cn.asked.Load() {
			conns++
		}
	}
	for cl := range h.calls {
		if cl.cn.asked.Load() {
			calls++
		} else {
			flood++
		}
	}
	h.mu.Unlock()
	if conns != 1 || calls != 1 {
		t.Errorf("kubelet's verdict in its handler: the hub counts %d of kubelet's connections and %d of its calls in flight, want 1 and 1", conns, calls)
	}
	if flood > 3 {
		t.Errorf("%d of the flood's calls in flight, want at most 3", flood)
	}
	free()
	if err := <-notified; err != nil {
		t.Fatalf("kubelet's verdict, its handler under way while stalled calls flooded: %v, want OK", err)
	}
	if v := <-verdicts; !v.Registered {
		t.Errorf("verdict %+v, want registered", v)
	}
	// The flood's oldest calls were cut, those on kubelet's socket.
	for i, p := range ps[:3] {
		if st, closed := p.ended(1, 5*time.Second); closed || st == "0" {
			t.Errorf("the flood's stalled call %d: grpc-status %q (connection closed: %v), want it cut", i, st, closed)
		}
	}
}

// TestAWholeMessageWithoutItsEndStalls: a call whose request message arrived whole but whose
// stream the client never ends has not reached its handler (grpc-go reads on to the end of a
// unary call's stream, and a second message there would take a buffer of its declared size):
// it is a stalled call, the oldest cut for a new one beyond the bound. Kubelet's calls get in.
func TestAWholeMessageWithoutItsEndStalls(t *testing.T) {
	h, gs := serveTestWith(t, 1, func(l *limits) { l.maxCalls = 1 }) // and 1 socket: 2 calls
	var ps []*h2
	for range 2 {
		before := connIDs.Load()
		p := dialH2(t, gs[0].path)
		p.call(1, "NotifyRegistrationStatus")
		if err := p.fr.WriteData(1, false, make([]byte, 5)); err != nil { // an empty message, whole
			t.Fatal(err)
		}
		waitCall(t, h, before)
		ps = append(ps, p)
	}
	testkit.Register(t, gs[0].path, testkit.Kubelet136, true, "") // its GetInfo cuts the oldest
	if st, closed := ps[0].ended(1, 5*time.Second); closed || st == "0" {
		t.Errorf("a call whose message is whole and whose stream never ended: grpc-status %q (connection closed: %v), want it cut", st, closed)
	}
}
