package registrar

import (
	"fmt"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"multireg.dev/multireg/internal/testkit"
)

// serveTest publishes n sockets in a short directory and serves each through one hub.
func serveTest(t *testing.T, n int) (*hub, []*generation) {
	t.Helper()
	h, err := newHub(testkit.Logger(t))
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
		l, id, err := publish(path)
		if err != nil {
			t.Fatal(err)
		}
		rs := &registrationServer{
			gen:    1,
			info:   &registerapi.PluginInfo{Type: "CSIPlugin", Name: fmt.Sprintf("d%d", i), SupportedVersions: []string{"1.0.0"}},
			notify: func(verdict) {}, onInfo: func() {}, onLate: func() {},
		}
		g, err := serve(h, l, path, id, rs)
		if err != nil {
			t.Fatal(err)
		}
		gs = append(gs, g)
	}
	return h, gs
}

// serving reports whether g has a gRPC server.
func serving(g *generation) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.srv != nil
}

// TestHubServesEverySocketWithoutAGoroutineEach: the sockets' connections are accepted by one
// loop, and a socket nobody is connected to has no server: 200 idle sockets add no goroutine
// beyond the hub's one, and each answers.
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
	testkit.Eventually(t, 10*time.Second, "every server gone with kubelet's connection, and their goroutines", func() bool {
		for _, g := range gs {
			if serving(g) {
				return false
			}
		}
		return runtime.NumGoroutine() <= before+5
	})
}

// TestGenerationServesAgainAfterIdle: a socket whose server went with its last connection
// serves the next one (kubelet restarting reads every socket again), and a stopped one
// refuses it.
func TestGenerationServesAgainAfterIdle(t *testing.T) {
	_, gs := serveTest(t, 1)
	g := gs[0]
	k := dialKubelet(t, g.path)
	k.getInfo(t)
	if !serving(g) {
		t.Fatal("no server while kubelet is connected")
	}
	k.conn.Close()
	testkit.Eventually(t, 5*time.Second, "the server gone with the connection", func() bool { return !serving(g) })
	register(t, g.path, true, "") // a new server
	g.stop()
	if answersGetInfo(g.path) {
		t.Error("a stopped generation still answers")
	}
}
