package regserver

import (
	"context"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/status"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"multireg.dev/multireg/internal/testkit"
)

func wantCode(t *testing.T, what string, err error, want codes.Code) {
	t.Helper()
	if got := status.Code(err); got != want {
		t.Errorf("%s: %v, want %s", what, err, want)
	}
}

// TestStopAnswersTheVerdictThatStoppedIt: the loop stops a generation when kubelet's verdict
// says so (a rejection); the reply to that verdict still reaches kubelet, whose client would
// otherwise count the call failed (kubelet ≥ 1.36 then deregisters the plugin).
func TestStopAnswersTheVerdictThatStoppedIt(t *testing.T) {
	_, gs := serveTest(t, 1)
	g := gs[0]
	stopped := make(chan struct{})
	g.rs.notify = func(Verdict) {
		go func() {
			defer close(stopped)
			g.Stop()
		}()
		testkit.Eventually(t, 5*time.Second, "stop under way", g.isStopped)
	}
	k := dialKubelet(t, g.path)
	k.GetInfo(t)
	k.Notify(t, false, "no")
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		t.Fatal("stop did not return")
	}
}

// TestStopFinishesTheCallsBegun: a call under way when stop comes is answered; the socket
// then serves nothing more, and stop returns once the call has ended.
func TestStopFinishesTheCallsBegun(t *testing.T) {
	_, gs := serveTest(t, 1)
	g := gs[0]
	k, called, release := slowGetInfo(t, g)
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		g.Stop()
	}()
	testkit.Eventually(t, 5*time.Second, "stop under way", g.isStopped)
	close(release)
	if err := <-called; err != nil {
		t.Errorf("the call begun before stop: %v, want its answer", err)
	}
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		t.Fatal("stop did not return")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_, err := k.C.GetInfo(ctx, &registerapi.InfoRequest{})
	if err == nil {
		t.Error("a call after stop was answered")
	}
}

// TestStopEndsIdleConnections: stop ends a connection idle between kubelet's calls (with
// GOAWAY, for its client to go elsewhere) and one that never began HTTP/2, within stopGrace.
func TestStopEndsIdleConnections(t *testing.T) {
	_, gs := serveTest(t, 1)
	g := gs[0]
	idle := dialKubelet(t, g.path)
	idle.GetInfo(t)
	mute, err := net.Dial("unix", g.path)
	if err != nil {
		t.Fatal(err)
	}
	defer mute.Close()
	testkit.Eventually(t, 5*time.Second, "both connections given to the server", func() bool {
		g.mu.Lock()
		defer g.mu.Unlock()
		return g.served == 1 && len(g.opening) == 1
	})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		g.Stop()
	}()
	select {
	case <-stopped:
	case <-time.After(stopGrace + 5*time.Second):
		t.Fatal("stop did not return")
	}
	_ = mute.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadAll(mute); err != nil {
		t.Errorf("the connection that never began HTTP/2: %v, want it closed", err)
	}
	testkit.Eventually(t, 5*time.Second, "the idle connection closed", func() bool {
		return idle.Conn.GetState() != connectivity.Ready
	})
}

// askedSocket serves one socket whose verdicts go to the channel, and a kubelet that asked its
// GetInfo.
func askedSocket(t *testing.T) (*Socket, *testkit.Kubelet, <-chan Verdict) {
	t.Helper()
	_, gs := serveTest(t, 1)
	verdicts := make(chan Verdict, 1)
	gs[0].rs.notify = func(v Verdict) { verdicts <- v }
	k := dialKubelet(t, gs[0].path)
	k.GetInfo(t)
	return gs[0], k, verdicts
}

// TestBoundsOnACall: a request over maxRequest is refused with ResourceExhausted, and the
// connection goes on serving; a rejection whose reason is ten times the longest kubelet
// writes (its handlers' errors, some hundred bytes) counts.
func TestBoundsOnACall(t *testing.T) {
	_, k, verdicts := askedSocket(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err := k.C.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{Error: strings.Repeat("x", maxRequest)})
	wantCode(t, "a verdict over maxRequest", err, codes.ResourceExhausted)
	k.GetInfo(t)
	long := "RegisterPlugin error -- plugin registration failed with err: " + strings.Repeat("a long reason ", 600)
	k.Notify(t, false, long)
	if v := <-verdicts; v.Registered || v.Msg != long {
		t.Errorf("a rejection of %d bytes: %+v", len(long), v)
	}
}

// TestRequestBuffersFitTheMemoryLimit: a call in flight holds a buffer of its request's declared
// size. With 1000 drivers, the calls the bounds allow (maxCalls and one per socket) must fit
// what the shipped 128 MiB limit leaves beside the drivers' own peak (71 MiB, BENCHMARKS.md)
// and the connections the bounds allow (some 35 MiB): at 64 KiB a request, a flood spread over
// the sockets got multireg OOM-killed (e2e/cmd/attack -drivers 1000 -kind unfinished).
func TestRequestBuffersFitTheMemoryLimit(t *testing.T) {
	const sockets, budget = 1000, 20 << 20
	maxCalls := defaultLimits().maxCalls
	if held := (maxCalls + sockets) * maxRequest; held > budget {
		t.Errorf("%d calls of %d KiB hold %d MiB, over the %d MiB budget", maxCalls+sockets, maxRequest>>10, held>>20, budget>>20)
	}
}

// slowGetInfo makes a kubelet call g's GetInfo, whose answer waits for release; it returns once
// the call has reached g, with the call's result to come.
func slowGetInfo(t *testing.T, g *Socket) (k *testkit.Kubelet, called <-chan error, release chan<- struct{}) {
	t.Helper()
	entered, rel := make(chan struct{}), make(chan struct{})
	g.rs.onInfo = func(string) { close(entered); <-rel }
	k = dialKubelet(t, g.path)
	res := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := k.C.GetInfo(ctx, &registerapi.InfoRequest{})
		res <- err
	}()
	<-entered
	return k, res, rel
}
