package registration

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"multireg.dev/multireg/e2e/kubelet"
	"multireg.dev/multireg/e2e/mrproc"
	"multireg.dev/multireg/e2e/plugins"
)

func TestMain(m *testing.M) {
	if _, err := mrproc.Binary(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Exit(m.Run())
}

// Timeouts, generous for a loaded 2-core machine: kubelet's reconciler runs once a second and
// backs off after failures (1, 2, 3, 5, 9 s …).
const (
	registerTimeout = 30 * time.Second
	exitTimeout     = 5 * time.Second
)

// env is one test's node: a registry directory watched by the real plugin manager, plugin
// endpoints, and a drivers file.
type env struct {
	t   *testing.T
	dir string // short: unix socket paths are at most 107 bytes
	reg string
	k   *kubelet.Kubelet
	eps map[string]*plugins.Endpoint
}

func newEnv(t *testing.T) *env {
	t.Helper()
	dir, err := os.MkdirTemp("", "e2e")
	if err != nil {
		t.Fatal(err)
	}
	e := &env{t: t, dir: dir, reg: filepath.Join(dir, "reg"), eps: map[string]*plugins.Endpoint{}}
	t.Cleanup(func() { os.RemoveAll(dir) })
	e.startKubelet()
	t.Cleanup(func() { e.k.Stop() })
	return e
}

func (e *env) startKubelet() {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	k, err := kubelet.Start(ctx, e.reg, kubelet.Options{})
	if err != nil {
		e.t.Fatal(err)
	}
	e.k = k
}

// driver is one entry of the drivers file.
type driver struct {
	name, typ string
	extra     string // more YAML lines for the entry, indented by four spaces
}

// endpointPath is where the driver's service socket lives.
func (e *env) endpointPath(d driver) string {
	return filepath.Join(e.dir, "ep", strings.NewReplacer("/", "_").Replace(d.name)+".sock")
}

// startEndpoint starts the driver's service.
func (e *env) startEndpoint(d driver) *plugins.Endpoint {
	e.t.Helper()
	return e.startEndpointAt(d, e.endpointPath(d))
}

// startEndpointAt starts the driver's service at path.
func (e *env) startEndpointAt(d driver, path string) *plugins.Endpoint {
	e.t.Helper()
	ep, err := plugins.Start(path, d.typ, d.name)
	if err != nil {
		e.t.Fatal(err)
	}
	e.eps[d.name] = ep
	e.t.Cleanup(ep.Stop)
	return ep
}

// startEndpoints starts every driver's service.
func (e *env) startEndpoints(ds []driver) {
	e.t.Helper()
	for _, d := range ds {
		e.startEndpoint(d)
	}
}

// registeredAgain reports whether kubelet has registered every driver once more than the
// counts in before, and holds it registered.
func (e *env) registeredAgain(ds []driver, before map[string]int) bool {
	for _, d := range ds {
		if e.k.Counts(d.name).Registrations != before[d.name]+1 || !e.k.Registered(d.name) {
			return false
		}
	}
	return true
}

// registeredIn reports whether multireg's log says Registered for every driver.
func registeredIn(p *mrproc.Process, ds []driver) bool {
	for _, d := range ds {
		if p.Phase(d.name) != "Registered" {
			return false
		}
	}
	return true
}

// socketPath is the driver's registration socket.
func (e *env) socketPath(d driver) string {
	return filepath.Join(e.reg, strings.NewReplacer("/", "_").Replace(d.name)+"-reg.sock")
}

// writeConfig writes the drivers file, with fast retries, and returns its path.
func (e *env) writeConfig(ds []driver) string {
	e.t.Helper()
	p := filepath.Join(e.dir, "drivers.yaml")
	if err := os.WriteFile(p, []byte(e.configContent(ds)), 0o644); err != nil {
		e.t.Fatal(err)
	}
	return p
}

// configContent is the drivers file for ds, with fast retries.
func (e *env) configContent(ds []driver) string {
	var b strings.Builder
	fmt.Fprintf(&b, "apiVersion: multireg.dev/v1alpha1\nkind: RegistrarConfig\nregistrationDir: %s\n", e.reg)
	b.WriteString("defaults:\n  backoff: {initialInterval: 200ms, maxInterval: 2s}\ndrivers:\n")
	for _, d := range ds {
		fmt.Fprintf(&b, "  - name: %s\n    type: %s\n    endpoint: %s\n", d.name, d.typ, e.endpointPath(d))
		if d.extra != "" {
			b.WriteString(d.extra)
		}
	}
	return b.String()
}

// mixed returns n drivers, a third of each type.
func mixed(n int) []driver {
	var ds []driver
	for i := range n {
		switch i % 3 {
		case 0:
			ds = append(ds, driver{name: fmt.Sprintf("csi%d.example.com", i), typ: "CSIPlugin"})
		case 1:
			ds = append(ds, driver{name: fmt.Sprintf("dra%d.example.com", i), typ: "DRAPlugin"})
		case 2:
			ds = append(ds, driver{name: fmt.Sprintf("example.com/dev%d", i), typ: "DevicePlugin"})
		}
	}
	return ds
}

// allRegistered reports whether kubelet has registered every driver.
func (e *env) allRegistered(ds []driver) bool {
	for _, d := range ds {
		if !e.k.Registered(d.name) {
			return false
		}
	}
	return true
}

// registrations returns each driver's count of successful registrations in kubelet.
func (e *env) registrations(ds []driver) map[string]int {
	m := map[string]int{}
	for _, d := range ds {
		m[d.name] = e.k.Counts(d.name).Registrations
	}
	return m
}

func (e *env) dumpOnFailure() {
	e.t.Cleanup(func() {
		if e.t.Failed() {
			e.t.Logf("kubelet %s events:\n%s", kubelet.Version(), kubelet.FormatEvents(e.k.Events()))
		}
	})
}

func isSocket(path string) bool {
	fi, err := os.Lstat(path)
	return err == nil && fi.Mode().Type() == os.ModeSocket
}
