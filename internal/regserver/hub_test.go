package regserver

import (
	"fmt"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"multireg.dev/multireg/internal/sockfile"
	"multireg.dev/multireg/internal/testkit"
)

// serveTest publishes n sockets in a short directory and serves each through one hub.
func serveTest(t testing.TB, n int) (*Hub, []*Socket) {
	t.Helper()
	return serveTestWith(t, n, nil)
}

// serveTestWith is serveTest with the hub's limits changed by lower, if not nil.
func serveTestWith(t testing.TB, n int, lower func(*limits)) (*Hub, []*Socket) {
	t.Helper()
	h, err := NewHub(testkit.Logger(t))
	if err != nil {
		t.Fatal(err)
	}
	if lower != nil {
		lower(&h.lim)
	}
	dir := testkit.ShortDir(t)
	var gs []*Socket
	t.Cleanup(func() {
		for _, g := range gs {
			g.Stop()
		}
		h.Close()
	})
	for i := range n {
		path := filepath.Join(dir, fmt.Sprintf("d%d.sock", i))
		l, _, err := sockfile.Publish(path, nil)
		if err != nil {
			t.Fatal(err)
		}
		g, err := Serve(h, l, path, Service{
			Gen:    1,
			Info:   &registerapi.PluginInfo{Type: "CSIPlugin", Name: fmt.Sprintf("d%d", i), SupportedVersions: []string{"1.0.0"}},
			Notify: func(Verdict) {}, OnInfo: func(string) {}, OnLate: func() {},
		}, nil)
		if err != nil {
			t.Fatal(err)
		}
		gs = append(gs, g)
	}
	return h, gs
}

// dialKubelet dials the socket as kubelet 1.36 does.
func dialKubelet(t testing.TB, socket string) *testkit.Kubelet {
	t.Helper()
	return testkit.DialKubelet(t, socket, testkit.Kubelet136)
}

// connected reports whether g serves a connection.
func (g *Socket) connected() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.served > 0 || len(g.opening) > 0
}

// TestHubServesEverySocketWithoutAGoroutineEach: the sockets' connections are accepted by one
// loop, and a connection's goroutine goes with it: 200 idle sockets add no goroutine beyond
// the hub's one, and each answers.
func TestHubServesEverySocketWithoutAGoroutineEach(t *testing.T) {
	before := runtime.NumGoroutine()
	_, gs := serveTest(t, 200)
	for _, g := range gs {
		k := dialKubelet(t, g.path)
		if got := k.GetInfo(t).Name; got != g.rs.info.Name {
			t.Fatalf("%s answered GetInfo for %q", g.path, got)
		}
		k.Notify(t, true, "")
		k.Conn.Close() // as kubelet does
	}
	testkit.Eventually(t, 10*time.Second, "every connection's goroutine gone with kubelet's connection", func() bool {
		for _, g := range gs {
			if g.connected() {
				return false
			}
		}
		return runtime.NumGoroutine() <= before+5
	})
}

// TestGenerationServesAgainAfterIdle: a socket whose last connection closed serves the next
// one (kubelet restarting reads every socket again), and a stopped one refuses it.
func TestGenerationServesAgainAfterIdle(t *testing.T) {
	_, gs := serveTest(t, 1)
	g := gs[0]
	k := dialKubelet(t, g.path)
	k.GetInfo(t)
	if !g.connected() {
		t.Fatal("no connection served while kubelet is connected")
	}
	k.Conn.Close()
	testkit.Eventually(t, 5*time.Second, "the connection's goroutine gone with it", func() bool { return !g.connected() })
	testkit.Register(t, g.path, testkit.Kubelet136, true, "")
	g.Stop()
	if sockfile.AnswersGetInfo(g.path) {
		t.Error("a stopped generation still answers")
	}
}

// TestStopWaitsForCallsInFlight: once stop has returned, no call of kubelet's reaches the
// loop. A call in flight is waited for, also when kubelet dropped its connection meanwhile (a
// verdict arriving then would be lost to a hand-over's detach), and later calls are refused.
func TestStopWaitsForCallsInFlight(t *testing.T) {
	_, gs := serveTest(t, 1)
	g := gs[0]
	k, called, release := slowGetInfo(t, g) // a call that takes its time
	defer func() { <-called }()
	k.Conn.Close() // kubelet gives up on the call
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		g.Stop()
	}()
	isStopped := func() bool {
		select {
		case <-stopped:
			return true
		default:
			return false
		}
	}
	testkit.Never(t, time.Second, "stop returned while a call was in flight", isStopped)
	close(release)
	testkit.Eventually(t, 5*time.Second, "stop returned once the call ended", isStopped)
	if sockfile.AnswersGetInfo(g.path) {
		t.Error("a call after stop was answered")
	}
}
