package regserver

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/tap"
	"multireg.dev/multireg/internal/sockfile"
	"multireg.dev/multireg/internal/throttle"
)

// What the clients of the registration sockets may hold, one connection, one socket and the
// whole process. Kubelet dials a socket, calls GetInfo at once, and NotifyRegistrationStatus
// on the same connection once the plugin's handler is done (seconds, sometimes minutes, later),
// one call at a time, each request a few hundred bytes sent whole; then it closes. Anything
// slower or larger is not kubelet, and is cut so that kubelet always finds room.
type limits struct {
	// firstCallTimeout: a connection on which no call began this long after it was accepted
	// is closed (an HTTP/2 preface alone, or a header block that never ends).
	firstCallTimeout time.Duration
	// callTimeout bounds a call from its headers to its end: the request must arrive whole,
	// and the reply be taken, within it (kubelet allows GetInfo 1 s, the verdict 5 s).
	callTimeout time.Duration
	// maxConnsPerSocket: connections one socket may hold. A new one beyond it takes the place
	// of the socket's connection idle the longest (no call in flight), or is refused.
	maxConnsPerSocket int
	// maxConns: connections the process may hold beyond one per socket served (kubelet
	// registering every socket at once holds one to each: 1000 drivers, 1000 connections),
	// beyond which a socket admits only its reserve (socketReserve connections), up to maxConns
	// more: a socket kubelet has yet to register, under a flood of the others, still gets
	// kubelet's connection. A connection under a flood of data costs some 250 KiB, measured.
	// The descriptor budget (Hub.Budget) bounds them too.
	maxConns int
	// socketReserve: connections a socket admits whatever the process holds.
	socketReserve int
	// maxCalls: calls still receiving their request, in the process, beyond one per socket
	// served (kubelet makes one call at a time on each socket's connection). Each may buffer a
	// request of up to maxRequest. A new call beyond it takes the place of the oldest of them,
	// or is refused with ResourceExhausted.
	//
	// A call whose request arrived whole (its message and the end of its stream: gRPC then
	// runs its handler, begin) neither counts nor is cut. Its request's buffer is freed; it
	// ends with its handler (GetInfo from memory, the verdict handed to the loop without
	// blocking; a reply of some hundred bytes is queued without waiting for the client's
	// window); such calls are bounded by the connections, maxCallStreams each. And gRPC no
	// longer watches its context: a cut would only have the hub forget a call in flight
	// (kubelet's verdict, as it was) and take its connection for idle, to be closed for the
	// next one.
	//
	// Kubelet's requests arrive whole within milliseconds of their headers: the oldest call
	// still receiving its request is a stalled one, unless more than the bound's worth of new
	// calls came within those milliseconds, and a new call always gets in, however fast a
	// flood's arrive.
	maxCalls int
}

// defaultLimits are the limits of every hub; the package's tests lower them on theirs.
func defaultLimits() limits {
	return limits{
		firstCallTimeout:  10 * time.Second,
		callTimeout:       10 * time.Second,
		maxConnsPerSocket: 4,
		maxConns:          256,
		socketReserve:     1,
		maxCalls:          32,
	}
}

// conn is what the hub and a generation's server know of one accepted connection. It is the
// connection's gRPC AuthInfo, so that a call finds it (connOf). Its fields are set by admit,
// before anything else sees it, but asked, which is atomic; what the connection is doing is
// the hub's (connUse).
type conn struct {
	credentials.CommonAuthInfo
	id    uint64
	c     net.Conn
	g     *Socket
	pid   int32       // the peer process (SO_PEERCRED); 0 when unknown
	timer *time.Timer // closes it when no call begins on it in firstCallTimeout (noCall)
	asked atomic.Bool // it called GetInfo
}

// connUse is what an admitted connection is doing, as the hub counts it (Hub.conns).
type connUse struct {
	last  uint64 // when its last call ended, or before that when it was accepted (Hub.seq)
	calls int32  // calls in flight
	began bool   // a call began on it
}

// call is one call in flight, from its headers (the tap) to its end. Its fields are set by
// tap, before the call goes on, but handled, the hub's (under its lock).
type call struct {
	cn      *conn
	at      time.Time
	cancel  context.CancelCauseFunc
	timeout context.CancelFunc
	after   func() bool // stops the context.AfterFunc that ends it
	// handled: its request arrived whole and its handler runs (begin). Until then it counts
	// in Hub.reading, and may be cut.
	handled bool
}

var (
	errCallTooLong  = errors.New("the call took longer than a registration socket allows (its request is not whole, or its reply is not taken)")
	errCallReplaced = errors.New("the call was cut: too many calls in flight on the registration sockets, and this one stalled")
)

// admit counts c, just accepted on g, against the bounds; nil when it is refused (the caller
// closes it). A connection idle the longest on g may be closed to make room.
func (h *Hub) admit(g *Socket, c *net.UnixConn) *conn {
	pid := peerPID(c)
	h.mu.Lock()
	defer h.mu.Unlock()
	if n := h.connsOf(g); n >= h.lim.maxConnsPerSocket && !h.evictFair(g, pid) {
		h.refused("connection", g.path, fmt.Sprintf("the socket holds %d connections, those of this connection's process each with a call in flight", n))
		return nil
	}
	if limit := h.connLimit(); (h.connsOf(g) >= h.lim.socketReserve || len(h.conns) >= limit+h.lim.maxConns) && len(h.conns) >= limit && !h.evict(nil, true) {
		h.refused("connection", g.path, fmt.Sprintf("the registration sockets hold %d connections", len(h.conns)))
		return nil
	}
	if h.fdRoom() <= 0 && !h.evict(nil, true) {
		h.refused("connection", g.path, "no file descriptor left for it: "+h.budgetText())
		return nil
	}
	cn := &conn{id: connIDs.Add(1), c: c, g: g, pid: pid}
	cn.CommonAuthInfo = credentials.CommonAuthInfo{SecurityLevel: credentials.NoSecurity}
	cn.timer = time.AfterFunc(h.lim.firstCallTimeout, func() { h.noCall(cn) }) // noCall takes mu: it runs after admit
	h.seq++
	h.conns[cn] = connUse{last: h.seq}
	return cn
}

// connsOf counts g's connections admitted and not released. mu is held.
func (h *Hub) connsOf(g *Socket) int {
	n := 0
	for cn := range h.conns {
		if cn.g == g {
			n++
		}
	}
	return n
}

// evictFair makes room on g, full, for a connection of process pid. When another process
// holds more of g's connections than pid does, plus one, it closes one of that process's, even
// one with a call in flight; otherwise one of pid's own with none. One without a call first,
// then as evictBefore orders them. A flood from one process, however fast it connects again,
// then never closes or keeps out another process's connection: kubelet's — where the processes
// are told apart. In a pod, every peer outside its PID namespace is pid 0 (SO_PEERCRED),
// kubelet's too, and evictBefore's order alone keeps kubelet's connection. False when there is
// nothing to close. mu is held.
func (h *Hub) evictFair(g *Socket, pid int32) bool {
	held := map[int32]int{}
	for cn := range h.conns {
		if cn.g == g {
			held[cn.pid]++
		}
	}
	top := pid
	for p, n := range held {
		if n > held[top] || (n == held[top] && p < top) {
			top = p
		}
	}
	other := top != pid && held[top] > held[pid]+1
	if !other {
		top = pid
	}
	var old *conn
	for cn, u := range h.conns {
		if cn.g != g || cn.pid != top || (!other && u.calls > 0) {
			continue
		}
		switch {
		case old == nil:
			old = cn
		case (u.calls == 0) != (h.conns[old].calls == 0):
			if u.calls == 0 {
				old = cn
			}
		case h.evictBefore(cn, old):
			old = cn
		}
	}
	if old == nil {
		return false
	}
	h.closeConn(old)
	why := "the connection idle the longest closed to make room for a new one"
	if other {
		why = fmt.Sprintf("a connection of process %d, which holds %d of the socket's, closed to make room for another process's", top, held[top])
	}
	h.refused("connection", g.path, why)
	return true
}

// peerPID returns the process at the other end of c, 0 when unknown (or outside this
// process's PID namespace).
func peerPID(c *net.UnixConn) int32 {
	cred, err := sockfile.PeerCred(c)
	if err != nil {
		return 0
	}
	return cred.Pid
}

// evict closes a connection with no call in flight, of g or (g nil) of any socket, to make
// room for a new one; false when there is none. With fresh, only one on which no call ever
// began. One that asked no GetInfo goes first (kubelet's connection awaits its verdict after
// GetInfo), then the one idle the longest, a connection's idleness counted from its accept or
// its last call: kubelet's new connection, which calls GetInfo at once, is the last. mu is
// held.
func (h *Hub) evict(g *Socket, fresh bool) bool {
	var old *conn
	for cn, u := range h.conns {
		if (g != nil && cn.g != g) || u.calls > 0 || (fresh && u.began) {
			continue
		}
		if old == nil || h.evictBefore(cn, old) {
			old = cn
		}
	}
	if old == nil {
		return false
	}
	h.closeConn(old)
	h.refused("connection", old.g.path, "the connection idle the longest closed to make room for a new one")
	return true
}

// evictBefore reports whether a goes before b, both admitted. mu is held.
func (h *Hub) evictBefore(a, b *conn) bool {
	if aa, ba := a.asked.Load(), b.asked.Load(); aa != ba {
		return !aa
	}
	return h.conns[a].last < h.conns[b].last
}

// refused counts a connection or call refused or cut and warns: one warning at most every
// throttle.Interval, with how many since the last: a flood of them must not flood the log.
func (h *Hub) refused(what, path, why string) {
	if log, n := h.refusals.Note(); log {
		h.log.Warn("refusing or cutting clients of the registration sockets beyond multireg's bounds",
			"what", what, "socket", path, "why", why, "since_last_warning", n, "next_warning_in", throttle.Interval)
	}
}

// noCall closes cn when no call began on it in the first call's timeout.
func (h *Hub) noCall(cn *conn) {
	h.mu.Lock()
	if u, admitted := h.conns[cn]; !admitted || u.began {
		h.mu.Unlock()
		return
	}
	h.closeConn(cn)
	h.refused("connection", cn.g.path, fmt.Sprintf("no call began on it within %s", h.lim.firstCallTimeout))
	h.mu.Unlock()
	cn.g.forget(cn)
}

// release forgets cn: its server ended it. It is idempotent.
func (h *Hub) release(cn *conn) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.releaseLocked(cn)
}

func (h *Hub) releaseLocked(cn *conn) {
	if _, admitted := h.conns[cn]; !admitted {
		return
	}
	cn.timer.Stop()
	delete(h.conns, cn)
}

// closeConn releases and closes cn, to make room or because it broke a bound. mu is held.
func (h *Hub) closeConn(cn *conn) {
	h.releaseLocked(cn)
	cn.c.Close()
}

// connLimit is how many connections the process holds before a socket admits only its
// reserve: maxConns, and one for each socket served. mu is held.
func (h *Hub) connLimit() int { return h.lim.maxConns + len(h.socks) }

// callLimit is how many calls may be receiving their request before a new one cuts the
// oldest stalled one: maxCalls, and one for each socket served. mu is held.
func (h *Hub) callLimit() int { return h.lim.maxCalls + len(h.socks) }

// tap admits a call whose headers arrived on a connection, giving it callTimeout; a call
// beyond callLimit cuts the oldest stalled call, or is refused. gRPC calls it on the
// connection's reading goroutine, before the call has a goroutine or has read its request.
func (h *Hub) tap(ctx context.Context, _ *tap.Info) (context.Context, error) {
	cn := connOf(ctx)
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.reading >= h.callLimit() && !h.cutStalled() {
		h.refused("call", cn.g.path, fmt.Sprintf("%d calls in flight on the registration sockets still receiving their request", h.reading))
		return nil, status.Error(codes.ResourceExhausted, "too many calls in flight on multireg's registration sockets; try again")
	}
	ctx, timeout := context.WithTimeoutCause(ctx, h.lim.callTimeout, errCallTooLong)
	ctx, cancel := context.WithCancelCause(ctx)
	cl := &call{cn: cn, at: time.Now(), cancel: cancel, timeout: timeout}
	h.calls[cl] = struct{}{}
	h.reading++
	if u, admitted := h.conns[cn]; admitted { // else cut since: nothing to count
		u.calls++
		if !u.began {
			u.began = true
			cn.timer.Stop()
		}
		h.conns[cn] = u
	}
	// The call's end: its stats' End (connStats), or, for a stream gRPC drops before its
	// handler, its context, cancelled with the stream.
	cl.after = context.AfterFunc(ctx, func() { h.endCall(cl) })
	return withCall(ctx, cl), nil
}

// begin is every socket's unary interceptor: gRPC calls it once the call's request arrived
// whole, its message and the end of its stream (a unary call's RecvMsg reads on to the end;
// stats' InPayload comes before, with the message alone, and a stream never ended stalls
// there), just before the handler. From then on the call is not cut, and does not count
// against callLimit.
func (h *Hub) begin(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if cl := callOf(ctx); cl != nil {
		h.handling(cl)
	}
	return handler(ctx, req)
}

// handling notes that cl's handler runs, unless cl ended or was cut meanwhile.
func (h *Hub) handling(cl *call) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if _, ok := h.calls[cl]; ok && !cl.handled {
		cl.handled = true
		h.reading--
	}
}

// cutStalled cuts the oldest call still receiving its request, a stalled one (kubelet's
// arrive whole within milliseconds); false when none is. A call whose handler runs is never
// cut. mu is held.
func (h *Hub) cutStalled() bool {
	var old *call
	for cl := range h.calls {
		if !cl.handled && (old == nil || cl.at.Before(old.at)) {
			old = cl
		}
	}
	if old == nil {
		return false
	}
	h.dropCall(old)
	old.cancel(errCallReplaced)
	return true
}

// endCall forgets cl; it is idempotent.
func (h *Hub) endCall(cl *call) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.dropCall(cl)
	cl.cancel(nil)
	cl.timeout()
}

type callKey struct{}

func withCall(ctx context.Context, cl *call) context.Context {
	return context.WithValue(ctx, callKey{}, cl)
}

// callOf returns the call ctx belongs to, or nil.
func callOf(ctx context.Context) *call {
	cl, _ := ctx.Value(callKey{}).(*call)
	return cl
}

func (h *Hub) dropCall(cl *call) {
	if _, ok := h.calls[cl]; !ok {
		return
	}
	delete(h.calls, cl)
	if !cl.handled {
		h.reading--
	}
	if u, admitted := h.conns[cl.cn]; admitted {
		u.calls--
		h.seq++
		u.last = h.seq
		h.conns[cl.cn] = u
	}
}
