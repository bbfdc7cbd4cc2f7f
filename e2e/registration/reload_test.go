package registration

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"k8s.io/kubernetes/pkg/volume/util"

	"multireg.dev/multireg/e2e/kubelet"
	"multireg.dev/multireg/e2e/mrproc"
)

// configMap is a drivers file in a ConfigMap volume, updated by kubelet's own AtomicWriter:
// config.yaml -> ..data/config.yaml, ..data -> ..<timestamp>, swapped with a rename.
type configMap struct {
	t   *testing.T
	dir string
	w   *util.AtomicWriter
}

func (e *env) newConfigMap() *configMap {
	e.t.Helper()
	dir := filepath.Join(e.dir, "cm")
	if err := os.Mkdir(dir, 0o755); err != nil {
		e.t.Fatal(err)
	}
	w, err := util.NewAtomicWriter(dir, "e2e")
	if err != nil {
		e.t.Fatal(err)
	}
	return &configMap{t: e.t, dir: dir, w: w}
}

func (c *configMap) path() string { return filepath.Join(c.dir, "config.yaml") }

func (c *configMap) write(content string) {
	c.t.Helper()
	if err := c.w.Write(map[string]util.FileProjection{"config.yaml": {Data: []byte(content), Mode: 0o644}}, nil); err != nil {
		c.t.Fatal(err)
	}
}

// inode returns the inode of the file at path, or 0.
func inode(path string) uint64 {
	fi, err := os.Lstat(path)
	if err != nil {
		return 0
	}
	return fi.Sys().(*syscall.Stat_t).Ino
}

func (e *env) inodes(ds []driver) map[string]uint64 {
	m := map[string]uint64{}
	for _, d := range ds {
		m[d.name] = inode(e.socketPath(d))
	}
	return m
}

// startAll starts the endpoints of ds, writes them into the ConfigMap, runs multireg on it and
// waits until kubelet has registered all of them.
func (e *env) startAll(cm *configMap, ds []driver) *mrproc.Process {
	e.t.Helper()
	e.startEndpoints(ds)
	cm.write(e.configContent(ds))
	p := mrproc.Start(e.t, cm.path())
	kubelet.WaitFor(e.t, registerTimeout, "every driver registered", func() bool { return e.allRegistered(ds) })
	kubelet.WaitFor(e.t, registerTimeout, "every driver Registered in multireg", func() bool { return registeredIn(p, ds) })
	return p
}

// 1. 100 drivers; one driver's endpoint is edited: exactly that driver registers again, the
// other 99 keep their sockets and see no new registration.
func TestReloadOneOfHundred(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.dumpOnFailure()
	cm := e.newConfigMap()
	ds := mixed(100)
	p := e.startAll(cm, ds)
	before, inodes := e.registrations(ds), e.inodes(ds)

	edited := ds[42]
	moved := driver{name: edited.name, typ: edited.typ}
	newEndpoint := filepath.Join(e.dir, "ep2", "moved.sock")
	e.startEndpointAt(moved, newEndpoint)
	content := strings.Replace(e.configContent(ds), "endpoint: "+e.endpointPath(edited)+"\n", "endpoint: "+newEndpoint+"\n", 1)
	cm.write(content)

	kubelet.WaitFor(t, registerTimeout, "the edited driver registered with its new endpoint", func() bool {
		eps := e.k.RegisteredEndpoints(edited.name)
		return len(eps) == 1 && eps[0] == newEndpoint
	})
	if c := e.k.Counts(edited.name); c.Registrations != before[edited.name]+1 {
		t.Errorf("edited driver: %+v, want one more registration", c)
	}
	for _, d := range ds {
		if d.name == edited.name {
			continue
		}
		if got := e.k.Counts(d.name).Registrations; got != before[d.name] {
			t.Errorf("%s registered again (%d → %d)", d.name, before[d.name], got)
		}
		if got := inode(e.socketPath(d)); got != inodes[d.name] {
			t.Errorf("%s: socket inode %d → %d", d.name, inodes[d.name], got)
		}
	}
	if n := p.Count("config reloaded", ""); n != 1 {
		t.Errorf("%d reloads logged, want 1", n)
	}
}

// 2. Ten drivers removed and ten added in one edit.
func TestReloadRemoveTenAddTen(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.dumpOnFailure()
	cm := e.newConfigMap()
	all := mixed(40)
	kept, removed, added := all[:20], all[20:30], all[30:]
	e.startAll(cm, append(append([]driver{}, kept...), removed...))
	before := e.registrations(kept)

	for _, d := range added {
		e.startEndpoint(d)
	}
	cm.write(e.configContent(append(append([]driver{}, kept...), added...)))
	kubelet.WaitFor(t, registerTimeout, "10 added registered and 10 removed deregistered", func() bool {
		for _, d := range removed {
			if e.k.Registered(d.name) {
				return false
			}
		}
		return e.allRegistered(added)
	})
	for _, d := range removed {
		if c := e.k.Counts(d.name); c.Deregistrations != 1 {
			t.Errorf("%s: %+v, want one deregistration", d.name, c)
		}
		if _, err := os.Lstat(e.socketPath(d)); !os.IsNotExist(err) {
			t.Errorf("%s: socket of a removed driver: %v", d.name, err)
		}
	}
	for _, d := range kept {
		if c := e.k.Counts(d.name); c.Registrations != before[d.name] || c.Deregistrations != 0 {
			t.Errorf("%s moved: %+v", d.name, c)
		}
	}
}

// 3. Invalid YAML, then a file with one invalid driver: nothing changes in kubelet. The fix
// applies.
func TestReloadInvalidKeepsRunning(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.dumpOnFailure()
	cm := e.newConfigMap()
	ds := mixed(6)
	p := e.startAll(cm, ds)
	events := len(e.k.Events())

	cm.write("apiVersion: multireg.dev/v1alpha1\nkind: RegistrarConfig\ndrivers: [\n")
	kubelet.WaitFor(t, registerTimeout, "the invalid YAML reported", func() bool { return p.Count("config not applied; the last good one stays in force", "") == 1 })
	bad := strings.Replace(e.configContent(ds), "endpoint: "+e.endpointPath(ds[0]), "endpoint: relative.sock", 1)
	cm.write(bad)
	kubelet.WaitFor(t, registerTimeout, "the invalid driver reported", func() bool { return p.Count("config not applied; the last good one stays in force", "") == 2 })
	kubelet.Never(t, 2*time.Second, "kubelet saw a change from an invalid file", func() bool { return len(e.k.Events()) != events })
	if !e.allRegistered(ds) {
		t.Fatal("a driver lost its registration over an invalid file")
	}

	extra := driver{name: "late.csi.example.com", typ: "CSIPlugin"}
	e.startEndpoint(extra)
	cm.write(e.configContent(append(append([]driver{}, ds...), extra)))
	kubelet.WaitFor(t, registerTimeout, "the fixed file applied", func() bool { return e.k.Registered(extra.name) })
	for _, d := range ds {
		if c := e.k.Counts(d.name); c.Registrations != 1 {
			t.Errorf("%s: %+v, want its first registration only", d.name, c)
		}
	}
}

// 4. The file touched 50 times with the same content: nothing happens.
func TestReloadTouchDoesNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.dumpOnFailure()
	cm := e.newConfigMap()
	ds := mixed(6)
	p := e.startAll(cm, ds)
	content := e.configContent(ds)
	events, logs := len(e.k.Events()), len(p.Records())
	data, err := filepath.EvalSymlinks(cm.path())
	if err != nil {
		t.Fatal(err)
	}
	for i := range 50 {
		now := time.Now()
		if err := os.Chtimes(data, now, now); err != nil { // what kubelet's periodic sync does
			t.Fatal(err)
		}
		if i%10 == 0 {
			if err := os.WriteFile(data, []byte(content), 0o644); err != nil { // same bytes, written again
				t.Fatal(err)
			}
			cm.write(content) // kubelet's writer, same payload
		}
		time.Sleep(20 * time.Millisecond) // pace the touches over a second, like a real sync
	}
	kubelet.Never(t, 2*time.Second, "a touch changed something", func() bool {
		return len(e.k.Events()) != events || len(p.Records()) != logs
	})
}

// 5. SIGHUP re-reads the file: an unchanged file does nothing; a change the watch cannot see
// is applied. The watch covers the file's directory and its resolved target's (an edit of the
// data file inside the ConfigMap's timestamped directory is applied by itself); what it cannot
// see is a symlink re-pointed in a directory on the way that is neither.
func TestReloadOnSIGHUP(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.dumpOnFailure()
	cm := e.newConfigMap()
	ds := mixed(3)
	p := e.startAll(cm, ds)
	events := len(e.k.Events())

	p.Signal(t, syscall.SIGHUP)
	kubelet.WaitFor(t, registerTimeout, "the SIGHUP logged", func() bool { return p.Count("SIGHUP: re-reading the config", "") == 1 })
	kubelet.Never(t, 2*time.Second, "a SIGHUP with an unchanged file changed something", func() bool {
		return len(e.k.Events()) != events || p.Count("config reloaded", "") != 0
	})

	// An edit of the data file inside the timestamped directory, the config's resolved target.
	inner := driver{name: "inner.csi.example.com", typ: "CSIPlugin"}
	e.startEndpoint(inner)
	ds = append(ds, inner)
	data, err := filepath.EvalSymlinks(cm.path())
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(data, []byte(e.configContent(ds)), 0o644); err != nil {
		t.Fatal(err)
	}
	kubelet.WaitFor(t, registerTimeout, "the edit of the resolved target applied", func() bool { return e.k.Registered(inner.name) })
	p.Signal(t, syscall.SIGTERM)
	if code := p.Wait(t, 5*time.Second); code != 0 {
		t.Fatalf("exit code %d after SIGTERM", code)
	}

	// link/config.yaml -> hop/config.yaml -> a/config.yaml: link/ and a/ are watched, hop/
	// is not. Re-pointing hop/config.yaml to b/config.yaml raises no event multireg sees.
	mk := func(name, content string) string {
		dir := filepath.Join(e.dir, name)
		if err := os.Mkdir(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		f := filepath.Join(dir, "config.yaml")
		if err := os.WriteFile(f, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		return f
	}
	a := mk("a", e.configContent(ds))
	extra := driver{name: "hup.csi.example.com", typ: "CSIPlugin"}
	e.startEndpoint(extra)
	b := mk("b", e.configContent(append(append([]driver{}, ds...), extra)))
	hop := filepath.Join(e.dir, "hop")
	link := filepath.Join(e.dir, "link")
	for _, dir := range []string{hop, link} {
		if err := os.Mkdir(dir, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink(a, filepath.Join(hop, "config.yaml")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(hop, "config.yaml"), filepath.Join(link, "config.yaml")); err != nil {
		t.Fatal(err)
	}
	p = mrproc.Start(t, filepath.Join(link, "config.yaml"))
	kubelet.WaitFor(t, registerTimeout, "every driver Registered in multireg", func() bool { return registeredIn(p, ds) })
	tmp := filepath.Join(hop, "next")
	if err := os.Symlink(b, tmp); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(hop, "config.yaml")); err != nil {
		t.Fatal(err)
	}
	kubelet.Never(t, 2*time.Second, "the hidden edit was applied without a SIGHUP", func() bool { return e.k.Registered(extra.name) })
	p.Signal(t, syscall.SIGHUP)
	kubelet.WaitFor(t, registerTimeout, "the edit applied after SIGHUP", func() bool { return e.k.Registered(extra.name) })
}
