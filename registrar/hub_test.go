package registrar

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/sockfile"
	"multireg.dev/multireg/internal/testkit"
)

// serveTest publishes n sockets in a short directory and serves each through one hub.
func serveTest(t *testing.T, n int) (*hub, []*generation) {
	t.Helper()
	return serveTestLog(t, n, testkit.Logger(t))
}

// serveTestLog is serveTest logging to log.
func serveTestLog(t *testing.T, n int, log *slog.Logger) (*hub, []*generation) {
	t.Helper()
	h, err := newHub(log)
	if err != nil {
		t.Fatal(err)
	}
	dir := testkit.ShortDir(t)
	var gs []*generation
	t.Cleanup(func() {
		for _, g := range gs {
			g.stop()
		}
		h.close()
	})
	for i := range n {
		path := filepath.Join(dir, fmt.Sprintf("d%d.sock", i))
		l, id, err := sockfile.Publish(path, nil)
		if err != nil {
			t.Fatal(err)
		}
		rs := &registrationServer{
			gen:    1,
			info:   &registerapi.PluginInfo{Type: "CSIPlugin", Name: fmt.Sprintf("d%d", i), SupportedVersions: []string{"1.0.0"}},
			notify: func(verdict) {}, onInfo: func(string) {}, onLate: func() {},
		}
		g, err := serve(h, l, path, id, rs)
		if err != nil {
			t.Fatal(err)
		}
		gs = append(gs, g)
	}
	return h, gs
}

// connected reports whether g serves a connection.
func (g *generation) connected() bool {
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
		if got := k.getInfo(t).Name; got != g.rs.info.Name {
			t.Fatalf("%s answered GetInfo for %q", g.path, got)
		}
		k.notify(t, true, "")
		k.conn.Close() // as kubelet does
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
	k.getInfo(t)
	if !g.connected() {
		t.Fatal("no connection served while kubelet is connected")
	}
	k.conn.Close()
	testkit.Eventually(t, 5*time.Second, "the connection's goroutine gone with it", func() bool { return !g.connected() })
	register(t, g.path, true, "")
	g.stop()
	if sockfile.AnswersGetInfo(g.path) {
		t.Error("a stopped generation still answers")
	}
}

// TestPublishThatCannotServeKeepsTheSocket: a new generation that cannot be served (here the
// hub has stopped) fails before its socket is renamed onto the path: the socket kubelet holds
// stays, and nothing else is left behind.
func TestPublishThatCannotServeKeepsTheSocket(t *testing.T) {
	dir := testkit.ShortDir(t)
	spec := handoverDrivers(t, dir)[1] // the device plugin
	d := newDriver(spec, testkit.Logger(t), nil, false)
	h, err := newHub(testkit.Logger(t))
	if err != nil {
		t.Fatal(err)
	}
	d.hub = h
	cur, err := d.publish(spec.SocketPath, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cur.stop()
	h.close()
	if _, err := d.publish(d.slot(cur), cur); err == nil || !strings.Contains(err.Error(), "stopping") {
		t.Fatalf("publish with the hub stopped: %v, want the error that says so", err)
	}
	if id, _, err := fsid.Stat(cur.path); err != nil || id != cur.id {
		t.Errorf("the registered socket was replaced or removed: %v, %v (was %v)", id, err, cur.id)
	}
	entries, err := os.ReadDir(filepath.Dir(cur.path))
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if sockfile.IsTempName(e.Name()) {
			t.Errorf("a temporary socket is left: %s", e.Name())
		}
	}
}

// TestStopWaitsForCallsInFlight: once stop has returned, no call of kubelet's reaches the
// loop. A call in flight is waited for, also when kubelet dropped its connection meanwhile (a
// verdict arriving then would be lost to a hand-over's detach), and later calls are refused.
func TestStopWaitsForCallsInFlight(t *testing.T) {
	_, gs := serveTest(t, 1)
	g := gs[0]
	entered, release := make(chan struct{}), make(chan struct{})
	g.rs.onInfo = func(string) { close(entered); <-release } // a call that takes its time
	k := dialKubelet(t, g.path)
	called := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := k.c.GetInfo(ctx, &registerapi.InfoRequest{})
		called <- err
	}()
	defer func() { <-called }()
	<-entered
	k.conn.Close() // kubelet gives up on the call
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		g.stop()
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
