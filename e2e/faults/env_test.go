// Package faults injects faults into a running multireg — in kubelet, in the drivers'
// endpoints, in the registration directory, in the drivers file and in the process itself —
// against the real kubelet plugin manager (1.36 with go.mod, 1.35 with kube135/go.mod), and
// asserts for each that multireg recovers and that nothing else moved. TestSoak runs a bounded
// chaos of the cheap-to-heal faults over more than 200 drivers (-soak sets its duration).
package faults

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"multireg.dev/multireg/e2e/kubelet"
	"multireg.dev/multireg/e2e/mrproc"
	"multireg.dev/multireg/e2e/plugins"
)

var soakDuration = flag.Duration("soak", 90*time.Second, "how long TestSoak injects faults (at most 5m in CI; longer needs a larger -timeout)")

func TestMain(m *testing.M) {
	flag.Parse()
	if _, err := mrproc.Binary(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Exit(m.Run())
}

// Timeouts, generous for a loaded 2-core machine: kubelet's reconciler runs once a second and
// backs off after failures (1, 2, 3, 5, 9 s …). Every wait is a poll with one of these
// deadlines; the assertions of "nothing happens" (kubelet.Never) hold for quietPeriod.
const (
	registerTimeout = 30 * time.Second
	exitTimeout     = 5 * time.Second
	quietPeriod     = 3 * time.Second
)

// env is one test's node: a registry directory watched by the real plugin manager, plugin
// endpoints, and a drivers file in its own directory.
type env struct {
	t   *testing.T
	dir string // short: unix socket paths are at most 107 bytes
	reg string // the plugins-registry directory
	cfg string // the drivers file
	k   *kubelet.Kubelet
	eps map[string]*plugins.Endpoint
}

// newEnv makes a node with a running kubelet.
func newEnv(t *testing.T) *env {
	t.Helper()
	e := newEnvWithoutKubelet(t)
	e.startKubelet()
	return e
}

// newEnvWithoutKubelet makes a node whose kubelet is not running yet (startKubelet starts it).
func newEnvWithoutKubelet(t *testing.T) *env {
	t.Helper()
	dir, err := os.MkdirTemp("", "f")
	if err != nil {
		t.Fatal(err)
	}
	e := &env{t: t, dir: dir, reg: filepath.Join(dir, "reg"), cfg: filepath.Join(dir, "cfg", "drivers.yaml"), eps: map[string]*plugins.Endpoint{}}
	if err := os.Mkdir(filepath.Dir(e.cfg), 0o755); err != nil {
		t.Fatal(err)
	}
	// Registered first, so that it runs last: after every process and endpoint has stopped.
	t.Cleanup(func() { os.RemoveAll(dir) })
	t.Cleanup(func() {
		if e.k != nil {
			e.k.Stop()
		}
	})
	t.Cleanup(func() {
		if t.Failed() && e.k != nil {
			t.Logf("kubelet %s events:\n%s", kubelet.Version(), kubelet.FormatEvents(e.k.Events()))
		}
	})
	return e
}

// startKubelet starts a kubelet on the registry directory. A kubelet restart is
// restartKubelet.
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

// restartKubelet stops the kubelet and starts a new one on the same directory, with empty
// state, like a restarted kubelet process.
func (e *env) restartKubelet() {
	e.t.Helper()
	e.k.Stop()
	e.k = nil
	e.startKubelet()
}

// driver is one entry of the drivers file.
type driver struct {
	name, typ string
	extra     string // more YAML lines for the entry, indented by four spaces
	ep        string // the endpoint's path; "" means the default one under dir/ep
}

// endpointPath is where the driver's service socket lives.
func (e *env) endpointPath(d driver) string {
	if d.ep != "" {
		return d.ep
	}
	return filepath.Join(e.dir, "ep", safe(d.name)+".sock")
}

func safe(name string) string { return strings.NewReplacer("/", "_").Replace(name) }

// startEndpoint starts the driver's service, answering to its own name.
func (e *env) startEndpoint(d driver) *plugins.Endpoint {
	e.t.Helper()
	return e.startEndpointAs(d, d.name)
}

// startEndpointAs starts the driver's service; a CSI driver answers GetPluginInfo with name.
func (e *env) startEndpointAs(d driver, name string) *plugins.Endpoint {
	e.t.Helper()
	ep, err := plugins.Start(e.endpointPath(d), d.typ, name)
	if err != nil {
		e.t.Fatal(err)
	}
	e.eps[d.name] = ep
	e.t.Cleanup(ep.Stop)
	return ep
}

// stopEndpoint stops the driver's service and removes its socket, as a crashing driver does.
func (e *env) stopEndpoint(d driver) {
	e.t.Helper()
	ep, ok := e.eps[d.name]
	if !ok {
		e.t.Fatalf("no endpoint for %s", d.name)
	}
	ep.Stop()
	delete(e.eps, d.name)
}

// socketPath is the driver's registration socket (the default socketName).
func (e *env) socketPath(d driver) string {
	return filepath.Join(e.reg, safe(d.name)+"-reg.sock")
}

// writeConfig replaces the drivers file with one for ds, in one rename, and returns its path.
func (e *env) writeConfig(ds []driver) string {
	e.t.Helper()
	e.writeConfigContent(e.configContent(ds))
	return e.cfg
}

// writeConfigContent replaces the drivers file with content, in one rename.
func (e *env) writeConfigContent(content string) {
	e.t.Helper()
	writeAtomic(e.t, e.cfg, []byte(content))
}

// writeAtomic writes a file beside path and renames it onto path.
func writeAtomic(t testing.TB, path string, b []byte) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// configContent is the drivers file for ds, with fast retries.
func (e *env) configContent(ds []driver) string {
	var b strings.Builder
	fmt.Fprintf(&b, "apiVersion: multireg.dev/v1alpha1\nkind: RegistrarConfig\nregistrationDir: %s\n", e.reg)
	b.WriteString("defaults:\n  backoff: {initialInterval: 200ms, maxInterval: 2s}\ndrivers:\n")
	for _, d := range ds {
		fmt.Fprintf(&b, "  - name: %s\n    type: %s\n    endpoint: %s\n", d.name, d.typ, e.endpointPath(d))
		b.WriteString(d.extra)
	}
	return b.String()
}

// mixed returns n drivers named with prefix, a third of each type.
func mixed(prefix string, n int) []driver {
	var ds []driver
	for i := range n {
		switch i % 3 {
		case 0:
			ds = append(ds, driver{name: fmt.Sprintf("%scsi%d.example.com", prefix, i), typ: "CSIPlugin"})
		case 1:
			ds = append(ds, driver{name: fmt.Sprintf("%sdra%d.example.com", prefix, i), typ: "DRAPlugin"})
		case 2:
			ds = append(ds, driver{name: fmt.Sprintf("example.com/%sdev%d", prefix, i), typ: "DevicePlugin"})
		}
	}
	return ds
}

// without returns ds minus the drivers named.
func without(ds []driver, names ...string) []driver {
	var out []driver
	for _, d := range ds {
		drop := false
		for _, n := range names {
			drop = drop || d.name == n
		}
		if !drop {
			out = append(out, d)
		}
	}
	return out
}

// recreateRegistry deletes the registry directory with all it holds and makes it anew.
// multireg recreates sockets (and the directory) while it is being deleted: again until it is
// gone.
func (e *env) recreateRegistry() {
	e.t.Helper()
	for i := 0; ; i++ {
		err := os.RemoveAll(e.reg)
		if err == nil {
			break
		}
		if i == 100 {
			e.t.Fatal(err)
		}
	}
	if err := os.Mkdir(e.reg, 0o750); err != nil && !os.IsExist(err) {
		e.t.Fatal(err)
	}
}

// startAll starts the endpoints of ds, writes the drivers file, runs multireg on it and waits
// until kubelet and multireg both have every driver registered.
func (e *env) startAll(ds []driver, args ...string) *mrproc.Process {
	e.t.Helper()
	for _, d := range ds {
		e.startEndpoint(d)
	}
	p := mrproc.Start(e.t, e.writeConfig(ds), args...)
	e.waitRegistered(p, ds)
	return p
}

// waitRegistered waits until kubelet has registered every driver of ds and multireg reports
// each Registered.
func (e *env) waitRegistered(p *mrproc.Process, ds []driver) {
	e.t.Helper()
	kubelet.WaitFor(e.t, registerTimeout, fmt.Sprintf("%d drivers registered in kubelet", len(ds)), func() bool { return e.allRegistered(ds) })
	waitPhases(e.t, p, ds, "Registered")
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

// fileID identifies a file: a file created anew at the same path differs in inode or change
// time.
type fileID struct {
	ino   uint64
	ctime syscall.Timespec
}

func idOf(path string) fileID {
	fi, err := os.Lstat(path)
	if err != nil {
		return fileID{}
	}
	st := fi.Sys().(*syscall.Stat_t)
	return fileID{ino: st.Ino, ctime: st.Ctim}
}

func isSocket(path string) bool {
	fi, err := os.Lstat(path)
	return err == nil && fi.Mode().Type() == os.ModeSocket
}

// snapshot is what kubelet and the file system say about some drivers at one moment.
type snapshot struct {
	counts map[string]kubelet.Counts
	ids    map[string]fileID
}

func (e *env) snap(ds []driver) snapshot {
	s := snapshot{counts: map[string]kubelet.Counts{}, ids: map[string]fileID{}}
	for _, d := range ds {
		s.counts[d.name] = e.k.Counts(d.name)
		s.ids[d.name] = idOf(e.socketPath(d))
	}
	return s
}

// moved describes how the drivers of ds differ from the snapshot (in kubelet: a call of any
// kind, a registration lost; on disk: the socket recreated), or "" if none moved.
func (e *env) moved(s snapshot, ds []driver) string {
	var diffs []string
	for _, d := range ds {
		if c := e.k.Counts(d.name); c != s.counts[d.name] {
			diffs = append(diffs, fmt.Sprintf("%s: kubelet calls %+v → %+v", d.name, s.counts[d.name], c))
		}
		if !e.k.Registered(d.name) {
			diffs = append(diffs, d.name+": not registered in kubelet")
		}
		if id := idOf(e.socketPath(d)); id != s.ids[d.name] {
			diffs = append(diffs, fmt.Sprintf("%s: socket %+v → %+v", d.name, s.ids[d.name], id))
		}
	}
	return strings.Join(diffs, "\n")
}

// assertUnmoved fails the test if a driver of ds moved since the snapshot.
func (e *env) assertUnmoved(s snapshot, ds []driver) {
	e.t.Helper()
	if m := e.moved(s, ds); m != "" {
		e.t.Errorf("drivers that the fault did not concern moved:\n%s", m)
	}
}

// holdUnmoved asserts for quietPeriod that no driver of ds moves.
func (e *env) holdUnmoved(s snapshot, ds []driver) {
	e.t.Helper()
	var why string
	kubelet.Never(e.t, quietPeriod, "a driver that the fault did not concern moved", func() bool {
		why = e.moved(s, ds)
		if why != "" {
			e.t.Log(why)
		}
		return why != ""
	})
}
