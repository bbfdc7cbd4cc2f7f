package kubelet_test

import (
	"context"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"

	"google.golang.org/grpc"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"multireg.dev/multireg/e2e/kubelet"
)

// testPlugin is a minimal registrar: the Registration service for one plugin on one
// registration socket, recording what kubelet notifies.
type testPlugin struct {
	registerapi.UnimplementedRegistrationServer

	path   string
	info   pluginInfo
	srv    *grpc.Server
	served chan struct{}

	mu       sync.Mutex
	statuses []status
}

type pluginInfo struct {
	Type, Name, Endpoint string
	Versions             []string
}

// status is one NotifyRegistrationStatus call.
type status struct {
	Registered bool
	Error      string
}

// servePlugin listens on path and serves GetInfo with info until the test ends or stop.
func servePlugin(t *testing.T, path string, info pluginInfo) *testPlugin {
	t.Helper()
	lis, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	p := &testPlugin{path: path, info: info, srv: grpc.NewServer(), served: make(chan struct{})}
	registerapi.RegisterRegistrationServer(p.srv, p)
	go func() {
		defer close(p.served)
		_ = p.srv.Serve(lis) // returns when stop closes the listener
	}()
	t.Cleanup(p.stop)
	return p
}

// stop stops serving and waits for it; closing the listener unlinks the socket, which is how a
// plugin deregisters. It is idempotent.
func (p *testPlugin) stop() {
	p.srv.Stop()
	<-p.served
}

func (p *testPlugin) GetInfo(context.Context, *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	return &registerapi.PluginInfo{
		Type:              p.info.Type,
		Name:              p.info.Name,
		Endpoint:          p.info.Endpoint,
		SupportedVersions: p.info.Versions,
	}, nil
}

func (p *testPlugin) NotifyRegistrationStatus(_ context.Context, s *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.statuses = append(p.statuses, status{Registered: s.PluginRegistered, Error: s.Error})
	return &registerapi.RegistrationStatusResponse{}, nil
}

func (p *testPlugin) Statuses() []status {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.statuses)
}

// listenEndpoint is a plugin's service socket: it accepts connections into its backlog, which
// is all the kubelet's endpoint check needs.
func listenEndpoint(t *testing.T, path string) {
	t.Helper()
	lis, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = lis.Close() })
}

// shortDir returns a fresh directory under os.TempDir(), not t.TempDir(), whose paths (test
// name included) can exceed the 107 bytes a unix socket path may have.
func shortDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "e2e")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	return dir
}

// startKubelet starts a fake kubelet on dir/registry that stops when the test ends.
func startKubelet(t *testing.T, dir string, opts kubelet.Options) *kubelet.Kubelet {
	t.Helper()
	if opts.Log == nil {
		opts.Log = testLogger(t)
	}
	k, err := kubelet.Start(t.Context(), filepath.Join(dir, "registry"), opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(k.Stop)
	return k
}

// testLogger logs to the test's output until the test's cleanups run: kubelet goroutines that
// Stop cannot wait for may still log after the test, and then must not write to it.
func testLogger(t *testing.T) *slog.Logger {
	w := &closableWriter{w: t.Output()}
	t.Cleanup(w.close)
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type closableWriter struct {
	mu     sync.Mutex
	w      io.Writer
	closed bool
}

func (c *closableWriter) Write(b []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return len(b), nil
	}
	return c.w.Write(b)
}

func (c *closableWriter) close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closed = true
}

// replacePlugin serves info on a hidden name beside path, which kubelet ignores, and renames
// that socket over path, as a registrar publishes a new socket over its old one.
func replacePlugin(t *testing.T, path string, info pluginInfo) *testPlugin {
	t.Helper()
	tmp := filepath.Join(filepath.Dir(path), ".new-"+filepath.Base(path))
	p := servePlugin(t, tmp, info)
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
	p.path = path
	return p
}

// removePlugin stops p and removes its socket (replacePlugin's listener does not know its
// final name).
func removePlugin(t *testing.T, p *testPlugin) {
	t.Helper()
	p.stop()
	if err := os.Remove(p.path); err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
}
