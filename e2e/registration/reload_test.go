package registration

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"k8s.io/kubernetes/pkg/volume/util"

	"multireg.dev/multireg/e2e/internal/fileid"
	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/mrproc"
	"multireg.dev/multireg/e2e/testenv"
)

// configMap is a drivers file in a ConfigMap volume, updated by kubelet's own AtomicWriter:
// config.yaml -> ..data/config.yaml, ..data -> ..<timestamp>, swapped with a rename.
type configMap struct {
	t   *testing.T
	dir string
	w   *util.AtomicWriter
}

func (e *env) newConfigMap() *configMap {
	e.T.Helper()
	dir := filepath.Join(e.Dir, "cm")
	if err := os.Mkdir(dir, 0o755); err != nil {
		e.T.Fatal(err)
	}
	w, err := util.NewAtomicWriter(dir, "e2e")
	if err != nil {
		e.T.Fatal(err)
	}
	return &configMap{t: e.T, dir: dir, w: w}
}

func (c *configMap) path() string { return filepath.Join(c.dir, "config.yaml") }

func (c *configMap) write(content string) {
	c.t.Helper()
	if err := c.w.Write(map[string]util.FileProjection{"config.yaml": {Data: []byte(content), Mode: 0o644}}, nil); err != nil {
		c.t.Fatal(err)
	}
}

func (e *env) inodes(ds []driver) map[string]uint64 {
	m := map[string]uint64{}
	for _, d := range ds {
		m[d.Name] = fileid.Of(e.SocketPath(d)).Ino
	}
	return m
}

// startAll starts the endpoints of ds, writes them into the ConfigMap, runs multireg on it and
// waits until kubelet has registered all of them.
func (e *env) startAll(cm *configMap, ds []driver) *mrproc.Process {
	e.T.Helper()
	e.StartEndpoints(ds)
	cm.write(e.ConfigContent(ds))
	p := mrproc.Start(e.T, cm.path())
	wait.For(e.T, registerTimeout, "every driver registered", func() bool { return e.AllRegistered(ds) })
	wait.For(e.T, registerTimeout, "every driver Registered in multireg", func() bool { return registeredIn(p, ds) })
	for _, d := range ds { // multireg's last step after a registration: settled
		e.AwaitNodeInfoRecorded(p, d)
	}
	return p
}

// 1. 100 drivers; one driver's endpoint is edited: exactly that driver registers again, the
// other 99 keep their sockets and see no new registration.
func TestReloadOneOfHundred(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cm := e.newConfigMap()
	ds := testenv.Mixed("", 100)
	p := e.startAll(cm, ds)
	before, inodes := e.Registrations(ds), e.inodes(ds)

	edited := ds[42]
	newEndpoint := filepath.Join(e.Dir, "ep2", "moved.sock")
	e.StartEndpoint(driver{Name: edited.Name, Type: edited.Type, Endpoint: newEndpoint})
	content := strings.Replace(e.ConfigContent(ds), "endpoint: "+e.EndpointPath(edited)+"\n", "endpoint: "+newEndpoint+"\n", 1)
	cm.write(content)

	wait.For(t, registerTimeout, "the edited driver registered with its new endpoint", func() bool {
		eps := e.K.RegisteredEndpoints(edited.Name)
		return len(eps) == 1 && eps[0] == newEndpoint
	})
	if c := e.K.Counts(edited.Name); c.Registrations != before[edited.Name]+1 {
		t.Errorf("edited driver: %+v, want one more registration", c)
	}
	for _, d := range ds {
		if d.Name == edited.Name {
			continue
		}
		if got := e.K.Counts(d.Name).Registrations; got != before[d.Name] {
			t.Errorf("%s registered again (%d → %d)", d.Name, before[d.Name], got)
		}
		if got := fileid.Of(e.SocketPath(d)).Ino; got != inodes[d.Name] {
			t.Errorf("%s: socket inode %d → %d", d.Name, inodes[d.Name], got)
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
	cm := e.newConfigMap()
	all := testenv.Mixed("", 40)
	kept, removed, added := all[:20], all[20:30], all[30:]
	e.startAll(cm, append(append([]driver{}, kept...), removed...))
	before := e.Registrations(kept)

	e.StartEndpoints(added)
	cm.write(e.ConfigContent(append(append([]driver{}, kept...), added...)))
	wait.For(t, registerTimeout, "10 added registered and 10 removed deregistered", func() bool {
		for _, d := range removed {
			if e.K.Registered(d.Name) {
				return false
			}
		}
		return e.AllRegistered(added)
	})
	for _, d := range removed {
		if c := e.K.Counts(d.Name); c.Deregistrations != 1 {
			t.Errorf("%s: %+v, want one deregistration", d.Name, c)
		}
		if _, err := os.Lstat(e.SocketPath(d)); !os.IsNotExist(err) {
			t.Errorf("%s: socket of a removed driver: %v", d.Name, err)
		}
	}
	for _, d := range kept {
		if c := e.K.Counts(d.Name); c.Registrations != before[d.Name] || c.Deregistrations != 0 {
			t.Errorf("%s moved: %+v", d.Name, c)
		}
	}
}

// 3. Invalid YAML, then a file with one invalid driver: nothing changes in kubelet. The fix
// applies.
func TestReloadInvalidKeepsRunning(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cm := e.newConfigMap()
	ds := testenv.Mixed("", 6)
	p := e.startAll(cm, ds)
	events := len(e.K.Events())

	cm.write("apiVersion: multireg.dev/v1alpha1\nkind: RegistrarConfig\ndrivers: [\n")
	wait.For(t, registerTimeout, "the invalid YAML reported", func() bool { return p.Count("config not applied; the last good one stays in force", "") == 1 })
	bad := strings.Replace(e.ConfigContent(ds), "endpoint: "+e.EndpointPath(ds[0]), "endpoint: relative.sock", 1)
	cm.write(bad)
	wait.For(t, registerTimeout, "the invalid driver reported", func() bool { return p.Count("config not applied; the last good one stays in force", "") == 2 })
	wait.Never(t, 2*time.Second, "kubelet saw a change from an invalid file", func() bool { return len(e.K.Events()) != events })
	if !e.AllRegistered(ds) {
		t.Fatal("a driver lost its registration over an invalid file")
	}

	extra := driver{Name: "late.csi.example.com", Type: "CSIPlugin"}
	e.StartEndpoint(extra)
	cm.write(e.ConfigContent(append(append([]driver{}, ds...), extra)))
	wait.For(t, registerTimeout, "the fixed file applied", func() bool { return e.K.Registered(extra.Name) })
	for _, d := range ds {
		if c := e.K.Counts(d.Name); c.Registrations != 1 {
			t.Errorf("%s: %+v, want its first registration only", d.Name, c)
		}
	}
}

// 4. The file touched 50 times with the same content: nothing happens.
func TestReloadTouchDoesNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cm := e.newConfigMap()
	ds := testenv.Mixed("", 6)
	p := e.startAll(cm, ds)
	// multireg's last start-up step: the burst's memory returned, and said so.
	wait.For(t, registerTimeout, "the start-up to be over", func() bool { return p.Count("start-up over: its memory is returned to the system", "") == 1 })
	content := e.ConfigContent(ds)
	events, logs := len(e.K.Events()), len(p.Records())
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
	wait.Never(t, 2*time.Second, "a touch changed something", func() bool {
		return len(e.K.Events()) != events || len(p.Records()) != logs
	})
}

// 5. SIGHUP re-reads the file: an unchanged file does nothing; a change the watch cannot see
// is applied. The watch covers the file's directory and its resolved target's (an edit of the
// data file inside the ConfigMap's timestamped directory is applied by itself); what it cannot
// see is a symlink re-pointed in a directory on the way that is neither.
func TestReloadOnSIGHUP(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cm := e.newConfigMap()
	ds := testenv.Mixed("", 3)
	p := e.startAll(cm, ds)
	events := len(e.K.Events())

	p.Signal(t, syscall.SIGHUP)
	wait.For(t, registerTimeout, "the SIGHUP logged", func() bool { return p.Count("SIGHUP: re-reading the config", "") == 1 })
	wait.Never(t, 2*time.Second, "a SIGHUP with an unchanged file changed something", func() bool {
		return len(e.K.Events()) != events || p.Count("config reloaded", "") != 0
	})

	// An edit of the data file inside the timestamped directory, the config's resolved target.
	inner := driver{Name: "inner.csi.example.com", Type: "CSIPlugin"}
	e.StartEndpoint(inner)
	ds = append(ds, inner)
	data, err := filepath.EvalSymlinks(cm.path())
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(data, []byte(e.ConfigContent(ds)), 0o644); err != nil {
		t.Fatal(err)
	}
	wait.For(t, registerTimeout, "the edit of the resolved target applied", func() bool { return e.K.Registered(inner.Name) })
	p.Signal(t, syscall.SIGTERM)
	if code := p.Wait(t, 5*time.Second); code != 0 {
		t.Fatalf("exit code %d after SIGTERM", code)
	}

	// link/config.yaml -> hop/config.yaml -> a/config.yaml: link/ and a/ are watched, hop/
	// is not. Re-pointing hop/config.yaml to b/config.yaml raises no event multireg sees.
	mk := func(name, content string) string {
		dir := filepath.Join(e.Dir, name)
		if err := os.Mkdir(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		f := filepath.Join(dir, "config.yaml")
		if err := os.WriteFile(f, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		return f
	}
	a := mk("a", e.ConfigContent(ds))
	extra := driver{Name: "hup.csi.example.com", Type: "CSIPlugin"}
	e.StartEndpoint(extra)
	b := mk("b", e.ConfigContent(append(append([]driver{}, ds...), extra)))
	hop := filepath.Join(e.Dir, "hop")
	link := filepath.Join(e.Dir, "link")
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
	wait.For(t, registerTimeout, "every driver Registered in multireg", func() bool { return registeredIn(p, ds) })
	tmp := filepath.Join(hop, "next")
	if err := os.Symlink(b, tmp); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(hop, "config.yaml")); err != nil {
		t.Fatal(err)
	}
	wait.Never(t, 2*time.Second, "the hidden edit was applied without a SIGHUP", func() bool { return e.K.Registered(extra.Name) })
	p.Signal(t, syscall.SIGHUP)
	wait.For(t, registerTimeout, "the edit applied after SIGHUP", func() bool { return e.K.Registered(extra.Name) })
}

// 6. A CSI driver's loop policy alone is edited (backoff, registrationTimeout,
// waitForEndpoint): kubelet sees nothing — no deregistration, no new registration, the same
// socket — and the running loop takes the new policy: its next failure waits the new backoff.
func TestReloadLoopPolicyOnly(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cm := e.newConfigMap()
	ds := testenv.Mixed("", 3) // a CSI driver, a DRA driver, a device plugin
	csi := ds[0]
	p := e.startAll(cm, ds)
	before, inodes := e.Registrations(ds), e.inodes(ds)
	events := len(e.K.Events())

	edited := slices.Clone(ds)
	edited[0].Extra = "    backoff: {initialInterval: 4s, maxInterval: 4s, randomizationFactor: 0}\n" +
		"    registrationTimeout: 30s\n    waitForEndpoint: false\n"
	cm.write(e.ConfigContent(edited))
	wait.For(t, registerTimeout, "the edit applied as an update of the CSI driver", func() bool {
		for _, r := range p.Records() {
			if r["msg"] == "config reloaded" {
				return fmt.Sprint(r["updated"]) == "["+csi.Name+"]" && fmt.Sprint(r["changed"]) == "[]"
			}
		}
		return false
	})
	wait.Never(t, 3*time.Second, "kubelet saw an edit of loop policy", func() bool { return len(e.K.Events()) != events })
	for _, d := range ds {
		if c := e.K.Counts(d.Name); c.Registrations != before[d.Name] || c.Deregistrations != 0 {
			t.Errorf("%s: %+v after the edit, want its first registration only", d.Name, c)
		}
		if got := fileid.Of(e.SocketPath(d)).Ino; got != inodes[d.Name] {
			t.Errorf("%s: socket inode %d → %d", d.Name, inodes[d.Name], got)
		}
	}

	// The next failure: kubelet rejects the socket published after someone removed it. The
	// loop took the new policy first, and backs off for its 4 s.
	e.K.FailRegistrations(csi.Name, 1)
	if err := os.Remove(e.SocketPath(csi)); err != nil {
		t.Fatal(err)
	}
	wait.For(t, registerTimeout, "the rejection", func() bool { return p.Count("registration failed", csi.Name) == 1 })
	for _, r := range p.Records() {
		switch {
		case r["driver"] != csi.Name:
		case r["msg"] == "loop policy updated; the registration stays":
			if r["registrationTimeout"] != float64(30*time.Second) || r["waitForEndpoint"] != false {
				t.Errorf("the policy taken: %v", r)
			}
		case r["msg"] == "registration failed":
			if r["retryIn"] != float64(4*time.Second) {
				t.Errorf("retry in %v ns after the rejection, want the new backoff's 4s", r["retryIn"])
			}
		}
	}
	if n := p.Count("loop policy updated; the registration stays", csi.Name); n != 1 {
		t.Errorf("the new policy taken %d times, want once", n)
	}
	wait.For(t, registerTimeout, "registered again after the backoff", func() bool {
		return e.K.Registered(csi.Name) && e.K.Counts(csi.Name).Registrations == before[csi.Name]+1
	})
}
