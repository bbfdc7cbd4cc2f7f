// Package testenv is one end-to-end test's node, shared by the suites that run the multireg
// binary (faults, registration): a short temporary directory with a plugins-registry
// directory watched by kubelet's real plugin manager (package kubelet), fake plugin endpoints
// (package plugins), and a drivers file alone in its own directory. multireg itself is
// started by the test (package mrproc). Everything ends with the test.
package testenv

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/kubelet"
	"multireg.dev/multireg/e2e/mrproc"
	"multireg.dev/multireg/e2e/plugins"
)

// Timeouts, generous for a loaded 2-core machine: kubelet's reconciler runs once a second and
// backs off after failures (1, 2, 3, 5, 9 s …).
const (
	RegisterTimeout = 30 * time.Second // for a driver to be registered, in kubelet or multireg
	ExitTimeout     = 5 * time.Second  // for multireg to exit after a signal
)

// Env is one test's node.
type Env struct {
	T   *testing.T
	Dir string           // short: unix socket paths are at most 107 bytes
	Reg string           // the plugins-registry directory
	Cfg string           // the drivers file
	K   *kubelet.Kubelet // nil while no kubelet runs
	// KubeletOptions are what StartKubelet starts kubelet with.
	KubeletOptions kubelet.Options
	eps            map[string]*plugins.Endpoint
}

// New makes a node with a running kubelet.
func New(t *testing.T) *Env {
	t.Helper()
	e := NewWithoutKubelet(t)
	e.StartKubelet()
	return e
}

// NewWithoutKubelet makes a node whose kubelet is not running yet (StartKubelet starts it).
// If the test fails, kubelet's events are logged.
func NewWithoutKubelet(t *testing.T) *Env {
	t.Helper()
	dir, err := os.MkdirTemp("", "e")
	if err != nil {
		t.Fatal(err)
	}
	e := &Env{T: t, Dir: dir, Reg: filepath.Join(dir, "reg"), Cfg: filepath.Join(dir, "cfg", "drivers.yaml"), eps: map[string]*plugins.Endpoint{}}
	if err := os.Mkdir(filepath.Dir(e.Cfg), 0o755); err != nil {
		t.Fatal(err)
	}
	// Registered first, so that it runs last: after every process and endpoint has stopped.
	t.Cleanup(func() { os.RemoveAll(dir) })
	t.Cleanup(func() {
		if e.K != nil {
			e.K.Stop()
		}
	})
	t.Cleanup(func() {
		if t.Failed() && e.K != nil {
			t.Logf("kubelet %s events:\n%s\n%s", kubelet.Version(), kubelet.FormatEvents(e.K.Events()), e.K.StateReport())
		}
	})
	return e
}

// StartKubelet starts a kubelet on the registry directory.
func (e *Env) StartKubelet() {
	e.T.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	k, err := kubelet.Start(ctx, e.Reg, e.KubeletOptions)
	if err != nil {
		e.T.Fatal(err)
	}
	e.K = k
}

// RestartKubelet stops the kubelet and starts a new one on the same directory, with empty
// state, like a restarted kubelet process.
func (e *Env) RestartKubelet() {
	e.T.Helper()
	e.K.Stop()
	e.K = nil
	e.StartKubelet()
}

// Driver is one entry of the drivers file.
type Driver struct {
	Name, Type string
	Extra      string // more YAML lines for the entry, indented by four spaces
	Endpoint   string // the endpoint's path; "" means the default one under Dir/ep
}

// Mixed returns n drivers named with prefix, a third of each type.
func Mixed(prefix string, n int) []Driver {
	var ds []Driver
	for i := range n {
		switch i % 3 {
		case 0:
			ds = append(ds, Driver{Name: fmt.Sprintf("%scsi%d.example.com", prefix, i), Type: "CSIPlugin"})
		case 1:
			ds = append(ds, Driver{Name: fmt.Sprintf("%sdra%d.example.com", prefix, i), Type: "DRAPlugin"})
		case 2:
			ds = append(ds, Driver{Name: fmt.Sprintf("example.com/%sdev%d", prefix, i), Type: "DevicePlugin"})
		}
	}
	return ds
}

// Without returns ds minus the drivers named.
func Without(ds []Driver, names ...string) []Driver {
	var out []Driver
	for _, d := range ds {
		drop := false
		for _, n := range names {
			drop = drop || d.Name == n
		}
		if !drop {
			out = append(out, d)
		}
	}
	return out
}

// Names returns the drivers' names.
func Names(ds []Driver) []string {
	var ns []string
	for _, d := range ds {
		ns = append(ns, d.Name)
	}
	return ns
}

// Safe is name as a file name: its slashes (a device plugin's resource name) become '_'.
func Safe(name string) string { return strings.NewReplacer("/", "_").Replace(name) }

// EndpointPath is where the driver's service socket lives.
func (e *Env) EndpointPath(d Driver) string {
	if d.Endpoint != "" {
		return d.Endpoint
	}
	return filepath.Join(e.Dir, "ep", Safe(d.Name)+".sock")
}

// SocketPath is the driver's registration socket (multireg's default socketName).
func (e *Env) SocketPath(d Driver) string {
	return filepath.Join(e.Reg, Safe(d.Name)+"-reg.sock")
}

// Socket is the driver's registration socket now: its first path, or its second where only
// that one is a socket (multireg publishes a DRA driver registered again, and a pattern's
// driver, at the path kubelet does not hold); the first when neither is.
func (e *Env) Socket(d Driver) string {
	if p := e.AltSocketPath(d); !IsSocket(e.SocketPath(d)) && IsSocket(p) {
		return p
	}
	return e.SocketPath(d)
}

// AltSocketPath is the driver's second registration socket path, which multireg gives a DRA
// driver and a driver whose endpoint is a pattern: the first's name with .1 before .sock.
func (e *Env) AltSocketPath(d Driver) string {
	return filepath.Join(e.Reg, Safe(d.Name)+"-reg.1.sock")
}

// StartEndpoint starts the driver's service, answering to its own name.
func (e *Env) StartEndpoint(d Driver) *plugins.Endpoint {
	e.T.Helper()
	return e.StartEndpointAs(d, d.Name)
}

// StartEndpointAs starts the driver's service; a CSI driver answers GetPluginInfo with name.
// It stops at the end of the test, or with StopEndpoint.
func (e *Env) StartEndpointAs(d Driver, name string) *plugins.Endpoint {
	e.T.Helper()
	ep, err := plugins.Start(e.EndpointPath(d), d.Type, name)
	if err != nil {
		e.T.Fatal(err)
	}
	e.eps[d.Name] = ep
	e.T.Cleanup(ep.Stop)
	return ep
}

// StartEndpoints starts every driver's service.
func (e *Env) StartEndpoints(ds []Driver) {
	e.T.Helper()
	for _, d := range ds {
		e.StartEndpoint(d)
	}
}

// AwaitNodeInfoRecorded waits until multireg has recorded the driver's CSI NodeGetInfo answer,
// as it does right after kubelet registers it: only then can it tell, after a restart, whether
// the registration may stay. Waiting for the call to be made is not enough: an endpoint stopped
// before its answer reaches multireg leaves nothing to compare, and the restart registers again.
// Other types return at once.
func (e *Env) AwaitNodeInfoRecorded(p *mrproc.Process, d Driver) {
	e.T.Helper()
	if d.Type != "CSIPlugin" {
		return
	}
	wait.For(e.T, RegisterTimeout, "multireg to record "+d.Name+"'s NodeGetInfo", func() bool {
		return p.Count("NodeGetInfo recorded; a restart that answers the same keeps the registration", d.Name) > 0
	})
}

// StopEndpoint stops the driver's service (the last one started) and removes its socket, as
// a crashing driver does.
func (e *Env) StopEndpoint(d Driver) {
	e.T.Helper()
	ep, ok := e.eps[d.Name]
	if !ok {
		e.T.Fatalf("no endpoint for %s", d.Name)
	}
	ep.Stop()
	delete(e.eps, d.Name)
}

// ConfigContent is the drivers file for ds, with fast retries.
func (e *Env) ConfigContent(ds []Driver) string {
	var b strings.Builder
	fmt.Fprintf(&b, "apiVersion: multireg.dev/v1alpha1\nkind: RegistrarConfig\nregistrationDir: %s\n", e.Reg)
	b.WriteString("defaults:\n  backoff: {initialInterval: 200ms, maxInterval: 2s}\ndrivers:\n")
	for _, d := range ds {
		fmt.Fprintf(&b, "  - name: %s\n    type: %s\n    endpoint: %s\n", d.Name, d.Type, e.EndpointPath(d))
		b.WriteString(d.Extra)
	}
	return b.String()
}

// WriteConfig replaces the drivers file with one for ds, in one rename, and returns its path.
func (e *Env) WriteConfig(ds []Driver) string {
	e.T.Helper()
	e.WriteConfigContent(e.ConfigContent(ds))
	return e.Cfg
}

// WriteConfigContent replaces the drivers file with content, in one rename.
func (e *Env) WriteConfigContent(content string) {
	e.T.Helper()
	tmp := e.Cfg + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		e.T.Fatal(err)
	}
	if err := os.Rename(tmp, e.Cfg); err != nil {
		e.T.Fatal(err)
	}
}

// RecreateRegistry deletes the registry directory with all it holds and makes it anew.
// multireg recreates sockets (and the directory) while it is being deleted: again until it is
// gone.
func (e *Env) RecreateRegistry() {
	e.T.Helper()
	for i := 0; ; i++ {
		err := os.RemoveAll(e.Reg)
		if err == nil {
			break
		}
		if i == 100 {
			e.T.Fatal(err)
		}
	}
	if err := os.Mkdir(e.Reg, 0o750); err != nil && !os.IsExist(err) {
		e.T.Fatal(err)
	}
}

// AllRegistered reports whether kubelet has registered every driver.
func (e *Env) AllRegistered(ds []Driver) bool {
	for _, d := range ds {
		if !e.K.Registered(d.Name) {
			return false
		}
	}
	return true
}

// Registrations returns each driver's count of successful registrations in kubelet.
func (e *Env) Registrations(ds []Driver) map[string]int {
	m := map[string]int{}
	for _, d := range ds {
		m[d.Name] = e.K.Counts(d.Name).Registrations
	}
	return m
}

// ServeRegistrar serves the Registration API of a CSI driver on path until the test ends or it
// is stopped, as another registrar would: it accepts every verdict and never recreates its
// socket. The socket file stays after it stops (remove it to play node-driver-registrar's exit).
func (e *Env) ServeRegistrar(path, name, endpoint string) *plugins.Registrar {
	e.T.Helper()
	r, err := plugins.ServeRegistrar(path, &registerapi.PluginInfo{
		Type: "CSIPlugin", Name: name, Endpoint: endpoint, SupportedVersions: []string{"1.0.0"},
	})
	if err != nil {
		e.T.Fatal(err)
	}
	e.T.Cleanup(r.Stop)
	return r
}

// Exists reports whether there is a file at path (not followed if a symlink).
func Exists(path string) bool {
	_, err := os.Lstat(path)
	return err == nil
}

// IsSocket reports whether the file at path is a socket.
func IsSocket(path string) bool {
	fi, err := os.Lstat(path)
	return err == nil && fi.Mode().Type() == os.ModeSocket
}

// FileHolds fails unless the regular file at path holds content.
func FileHolds(path, content string) error {
	fi, err := os.Lstat(path)
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("%s is %v, not a regular file", path, fi.Mode().Type())
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	if string(b) != content {
		return fmt.Errorf("%s holds %q, want %q", path, b, content)
	}
	return nil
}
