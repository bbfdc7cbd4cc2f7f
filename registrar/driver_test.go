package registrar

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"multireg.dev/multireg/config"
)

func TestTypesMatchKubelet(t *testing.T) {
	for got, want := range map[string]string{
		config.CSIPlugin:    registerapi.CSIPlugin,
		config.DRAPlugin:    registerapi.DRAPlugin,
		config.DevicePlugin: registerapi.DevicePlugin,
	} {
		if got != want {
			t.Errorf("config type %q, kubelet's %q", got, want)
		}
	}
}

func TestRegistersAndAnswersGetInfo(t *testing.T) {
	dir := shortDir(t)
	ep := filepath.Join(dir, "ep", "csi.sock")
	startEndpoint(t, ep, "nfs.csi.k8s.io")
	d := testDriver(dir, "nfs.csi.k8s.io", config.CSIPlugin, ep)
	d.Endpoint = "/var/lib/kubelet/plugins/nfs/csi.sock" // what kubelet dials differs from what multireg sees
	s := runSupervisor(t, Options{})
	s.Start(d)

	awaitSocket(t, d)
	fi, err := os.Stat(d.SocketPath)
	if err != nil {
		t.Fatal(err)
	}
	if perm := fi.Mode().Perm(); perm != 0o600 {
		t.Errorf("socket mode %o, want 600", perm)
	}
	if di, err := os.Stat(filepath.Dir(d.SocketPath)); err != nil || di.Mode().Perm() != 0o750 {
		t.Errorf("registration directory created with %v (%v), want 0750", di.Mode().Perm(), err)
	}
	eventually(t, 5*time.Second, "Serving, endpoint up, 1 attempt before the verdict", func() bool {
		st := statusOf(s, d.Name)
		return st.Phase == Serving && st.EndpointUp && st.Attempts == 1
	})

	info := register(t, d.SocketPath, true, "")
	want := &registerapi.PluginInfo{
		Type:              "CSIPlugin",
		Name:              "nfs.csi.k8s.io",
		Endpoint:          "/var/lib/kubelet/plugins/nfs/csi.sock",
		SupportedVersions: []string{"1.0.0"},
	}
	if info.Type != want.Type || info.Name != want.Name || info.Endpoint != want.Endpoint || !reflect.DeepEqual(info.SupportedVersions, want.SupportedVersions) {
		t.Errorf("GetInfo = %v, want %v", info, want)
	}
	eventually(t, 5*time.Second, "Registered", func() bool { return statusOf(s, d.Name).Phase == Registered })

	// No temporary socket is left behind.
	entries, err := os.ReadDir(filepath.Dir(d.SocketPath))
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != 1 {
		t.Errorf("registration directory holds %d entries, want only the socket: %v", len(entries), entries)
	}
}

func TestRejectionRecreatesSocket(t *testing.T) {
	dir := shortDir(t)
	ep := filepath.Join(dir, "ep", "dra.sock")
	startEndpoint(t, ep, "")
	d := testDriver(dir, "gpu.example.com", config.DRAPlugin, ep)
	s := runSupervisor(t, Options{})
	s.Start(d)

	awaitSocket(t, d)
	first := mustID(t, d.SocketPath)
	register(t, d.SocketPath, false, "RegisterPlugin error -- plugin registration failed with err: boom")

	// A new generation replaces the rejected one after the backoff interval.
	eventually(t, 5*time.Second, "a new socket", func() bool {
		id, _, err := statID(d.SocketPath)
		return err == nil && id != first
	})
	st := statusOf(s, d.Name)
	if st.Failures != 1 || st.Attempts != 2 || !strings.Contains(st.LastError, "boom") {
		t.Errorf("status after one rejection: %+v, want 1 failure, 2 attempts, kubelet's error", st)
	}
	registerAndWait(t, s, d)
	if st := statusOf(s, d.Name); st.LastError != "" {
		t.Errorf("last error %q after registration, want none", st.LastError)
	}
}

// TestRejectionRemovesSocketWhileBackingOff checks that a rejected socket is removed before
// the backoff wait, so that kubelet deregisters it (kubelet <= 1.35 keeps a plugin whose
// registration failed until its socket goes).
func TestRejectionRemovesSocketWhileBackingOff(t *testing.T) {
	dir := shortDir(t)
	ep := filepath.Join(dir, "ep", "dp.sock")
	startEndpoint(t, ep, "")
	d := testDriver(dir, "vendor.example/gpu", config.DevicePlugin, ep)
	d.Backoff.InitialInterval = time.Minute // stays in BackingOff for the test
	d.Backoff.MaxInterval = time.Minute
	s := runSupervisor(t, Options{})
	s.Start(d)
	awaitSocket(t, d)
	register(t, d.SocketPath, false, "no")
	eventually(t, 5*time.Second, "BackingOff", func() bool { return statusOf(s, d.Name).Phase == BackingOff })
	if _, err := os.Lstat(d.SocketPath); !os.IsNotExist(err) {
		t.Errorf("socket during backoff: %v, want it removed", err)
	}
	st := statusOf(s, d.Name)
	if wait := time.Until(st.NextAttempt); wait < 30*time.Second || wait > 90*time.Second {
		t.Errorf("next attempt in %s, want about a minute (±20%%)", wait)
	}
}

func TestDeletedSocketIsRecreated(t *testing.T) {
	dir := shortDir(t)
	ep := filepath.Join(dir, "ep", "csi.sock")
	startEndpoint(t, ep, "nfs.csi.k8s.io")
	d := testDriver(dir, "nfs.csi.k8s.io", config.CSIPlugin, ep)
	d.Backoff.InitialInterval = time.Minute // recreation must not wait for a backoff
	d.Backoff.MaxInterval = time.Minute
	s := runSupervisor(t, Options{})
	s.Start(d)
	awaitSocket(t, d)
	registerAndWait(t, s, d)

	if err := os.Remove(d.SocketPath); err != nil {
		t.Fatal(err)
	}
	eventually(t, time.Second, "socket recreated within 1s", func() bool { return isSocket(d.SocketPath) })
	eventually(t, 5*time.Second, "Serving, 2 attempts after the recreation", func() bool {
		st := statusOf(s, d.Name)
		return st.Phase == Serving && st.Attempts == 2
	})
	register(t, d.SocketPath, true, "")
	eventually(t, 5*time.Second, "Registered again", func() bool { return statusOf(s, d.Name).Phase == Registered })
}

func TestRegistrationDirectoryRecreated(t *testing.T) {
	dir := shortDir(t)
	ep := filepath.Join(dir, "ep", "dp.sock")
	startEndpoint(t, ep, "")
	d := testDriver(dir, "vendor.example/gpu", config.DevicePlugin, ep)
	s := runSupervisor(t, Options{})
	s.Start(d)
	awaitSocket(t, d)
	first := mustID(t, d.SocketPath)

	// Delete the directory as one step (a recursive delete races with the recreation).
	reg := filepath.Dir(d.SocketPath)
	if err := os.Rename(reg, reg+".old"); err != nil {
		t.Fatal(err)
	}
	if err := os.RemoveAll(reg + ".old"); err != nil {
		t.Fatal(err)
	}
	eventually(t, time.Second, "socket recreated within 1s", func() bool {
		id, _, err := statID(d.SocketPath)
		return err == nil && id != first
	})
	// The new directory is watched: deleting the new socket is noticed too.
	second := mustID(t, d.SocketPath)
	if err := os.Remove(d.SocketPath); err != nil {
		t.Fatal(err)
	}
	eventually(t, time.Second, "socket recreated again", func() bool {
		id, _, err := statID(d.SocketPath)
		return err == nil && id != second
	})
}

func TestNonSocketInTheWayIsLeftAlone(t *testing.T) {
	for _, kind := range []string{"file", "directory", "symlink"} {
		t.Run(kind, func(t *testing.T) {
			dir := shortDir(t)
			ep := filepath.Join(dir, "ep", "csi.sock")
			startEndpoint(t, ep, "nfs.csi.k8s.io")
			d := testDriver(dir, "nfs.csi.k8s.io", config.CSIPlugin, ep)
			block(t, kind, d.SocketPath)
			other := testDriver(dir, "smb.csi.k8s.io", config.CSIPlugin, filepath.Join(dir, "ep2", "csi.sock"))
			startEndpoint(t, other.LocalEndpoint, other.Name)

			s := runSupervisor(t, Options{})
			s.Start(d)
			s.Start(other)
			eventually(t, 5*time.Second, "BackingOff with the reason", func() bool {
				st := statusOf(s, d.Name)
				return st.Phase == BackingOff && strings.Contains(st.LastError, "is a "+kind+", not a socket: it is left untouched")
			})
			// The other driver is not affected.
			eventually(t, 5*time.Second, "the other driver's socket", func() bool { return isSocket(other.SocketPath) })
			// Still there, unchanged, after several retries.
			eventually(t, 5*time.Second, "several retries", func() bool { return statusOf(s, d.Name).Failures >= 3 })
			fi, err := os.Lstat(d.SocketPath)
			if err != nil {
				t.Fatalf("%s in the way: %v", kind, err)
			}
			if kind == "file" {
				if b, _ := os.ReadFile(d.SocketPath); string(b) != "precious" || !fi.Mode().IsRegular() {
					t.Errorf("the file was touched: %q, %v", b, fi.Mode())
				}
			}
			// Once the user removes it, the socket comes.
			if err := os.Remove(d.SocketPath); err != nil {
				t.Fatal(err)
			}
			eventually(t, 5*time.Second, "socket after the way is clear", func() bool { return isSocket(d.SocketPath) })
		})
	}
}

// TestSocketPublishedOnceTheWayIsClear: while something that is not a socket blocks the
// socket's path, the loop watches the path: its removal publishes the socket at once, not
// when the backoff interval (a minute here) ends. A change that leaves it in the way starts
// no attempt.
func TestSocketPublishedOnceTheWayIsClear(t *testing.T) {
	for _, kind := range []string{"file", "directory", "symlink"} {
		t.Run(kind, func(t *testing.T) {
			dir := shortDir(t)
			ep := filepath.Join(dir, "ep", "dp.sock")
			startEndpoint(t, ep, "")
			d := testDriver(dir, "vendor.example/gpu", config.DevicePlugin, ep)
			d.Backoff = config.Backoff{InitialInterval: time.Minute, MaxInterval: time.Minute, Multiplier: 2}
			block(t, kind, d.SocketPath)
			s := runSupervisor(t, Options{})
			s.Start(d)
			eventually(t, 5*time.Second, "BackingOff with the reason", func() bool {
				st := statusOf(s, d.Name)
				return st.Phase == BackingOff && strings.Contains(st.LastError, "is a "+kind+", not a socket")
			})
			if kind != "symlink" { // a symlink's times are its target's
				attempts := statusOf(s, d.Name).Attempts
				if err := os.Chtimes(d.SocketPath, time.Now(), time.Now()); err != nil {
					t.Fatal(err)
				}
				never(t, 300*time.Millisecond, "a change of the "+kind+" in the way started an attempt", func() bool {
					return statusOf(s, d.Name).Attempts != attempts
				})
			}
			if err := os.Remove(d.SocketPath); err != nil {
				t.Fatal(err)
			}
			eventually(t, 5*time.Second, "socket once the way is clear, long before the backoff ends", func() bool { return isSocket(d.SocketPath) })
		})
	}
}

// block puts something that is not a socket at path: a "file", a "directory" or a "symlink".
func block(t *testing.T, kind, path string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
		t.Fatal(err)
	}
	var err error
	switch kind {
	case "file":
		err = os.WriteFile(path, []byte("precious"), 0o644)
	case "directory":
		err = os.Mkdir(path, 0o755)
	case "symlink":
		err = os.Symlink(filepath.Join(filepath.Dir(path), "nowhere"), path)
	}
	if err != nil {
		t.Fatal(err)
	}
}

func TestRegistrationTimeoutRecreates(t *testing.T) {
	dir := shortDir(t)
	ep := filepath.Join(dir, "ep", "dp.sock")
	startEndpoint(t, ep, "")
	d := testDriver(dir, "vendor.example/gpu", config.DevicePlugin, ep)
	d.RegistrationTimeout = time.Second
	s := runSupervisor(t, Options{})
	s.Start(d)
	awaitSocket(t, d)
	first := mustID(t, d.SocketPath)
	eventually(t, 5*time.Second, "socket recreated after the timeout", func() bool {
		id, _, err := statID(d.SocketPath)
		return err == nil && id != first
	})
	st := statusOf(s, d.Name)
	if st.Failures < 1 || !strings.Contains(st.LastError, "no registration verdict from kubelet within 1s") {
		t.Errorf("status after a timeout: %+v", st)
	}
	// Once registered, the timeout no longer applies.
	registerAndWait(t, s, d)
	registered := mustID(t, d.SocketPath)
	never(t, 1500*time.Millisecond, "a registered socket recreated by the timeout", func() bool {
		return mustID(t, d.SocketPath) != registered
	})
}

// TestSlowRegistrationCompletes: kubelet's registration of the plugin takes longer than
// registrationTimeout (a slow NodeGetInfo). Each timeout lets the next attempt wait longer,
// so the driver ends Registered; the registration brings the timeout back to the configured
// one.
func TestSlowRegistrationCompletes(t *testing.T) {
	dir := shortDir(t)
	ep := filepath.Join(dir, "ep", "dp.sock")
	startEndpoint(t, ep, "")
	d := testDriver(dir, "vendor.example/gpu", config.DevicePlugin, ep)
	d.RegistrationTimeout = time.Second
	s := runSupervisor(t, Options{})
	s.Start(d)
	stop := runSlowKubelet(t, d.SocketPath, 1500*time.Millisecond)
	eventually(t, 20*time.Second, "Registered although kubelet takes 1.5s", func() bool { return statusOf(s, d.Name).Phase == Registered })
	if st := statusOf(s, d.Name); st.Results[ResultTimeout] < 1 {
		t.Errorf("registered without a timeout first: %+v", st)
	}
	stop()

	// A new socket that nobody answers times out after the configured timeout again.
	if err := os.Remove(d.SocketPath); err != nil {
		t.Fatal(err)
	}
	const want = "no registration verdict from kubelet within 1s; the next attempt allows 2s"
	eventually(t, 5*time.Second, "a timeout after the configured 1s", func() bool { return statusOf(s, d.Name).LastError == want })
}

func TestWaitsForEndpointAndWakesOnCreate(t *testing.T) {
	dir := shortDir(t)
	ep := filepath.Join(dir, "ep", "csi.sock")
	if err := os.MkdirAll(filepath.Dir(ep), 0o755); err != nil {
		t.Fatal(err)
	}
	d := testDriver(dir, "nfs.csi.k8s.io", config.CSIPlugin, ep)
	// After the first failed probe the loop would wait a minute; the endpoint's Create
	// event must wake it at once.
	d.Backoff.InitialInterval = time.Minute
	d.Backoff.MaxInterval = time.Minute
	s := runSupervisor(t, Options{})
	s.Start(d)
	eventually(t, 5*time.Second, "WaitingForEndpoint", func() bool {
		st := statusOf(s, d.Name)
		return st.Phase == WaitingForEndpoint && strings.Contains(st.LastError, "does not accept connections")
	})
	if _, err := os.Lstat(d.SocketPath); !os.IsNotExist(err) {
		t.Fatalf("socket published before the endpoint is up: %v", err)
	}
	startEndpoint(t, ep, "nfs.csi.k8s.io")
	eventually(t, 5*time.Second, "socket once the endpoint is up", func() bool { return isSocket(d.SocketPath) })
}

func TestCSINameMismatch(t *testing.T) {
	dir := shortDir(t)
	ep := filepath.Join(dir, "ep", "csi.sock")
	startEndpoint(t, ep, "smb.csi.k8s.io")
	d := testDriver(dir, "nfs.csi.k8s.io", config.CSIPlugin, ep)
	s := runSupervisor(t, Options{})
	s.Start(d)
	want := `reports the name "smb.csi.k8s.io", but the config names it "nfs.csi.k8s.io"`
	eventually(t, 5*time.Second, "a name mismatch", func() bool {
		st := statusOf(s, d.Name)
		return st.Phase == WaitingForEndpoint && strings.Contains(st.LastError, want)
	})
	if _, err := os.Lstat(d.SocketPath); !os.IsNotExist(err) {
		t.Errorf("socket published for a driver with another name: %v", err)
	}
}

func TestEndpointRestartReregisters(t *testing.T) {
	dir := shortDir(t)
	ep := filepath.Join(dir, "ep", "csi.sock")
	e := startEndpoint(t, ep, "nfs.csi.k8s.io")
	d := testDriver(dir, "nfs.csi.k8s.io", config.CSIPlugin, ep)
	s := runSupervisor(t, Options{})
	s.Start(d)
	awaitSocket(t, d)
	registerAndWait(t, s, d)
	first := mustID(t, d.SocketPath)

	// The driver dies: the registration stays, the endpoint shows as down.
	e.stop()
	eventually(t, 5*time.Second, "endpoint down", func() bool { return !statusOf(s, d.Name).EndpointUp })
	if id := mustID(t, d.SocketPath); id != first {
		t.Fatal("the registration socket changed when the endpoint went away")
	}
	if st := statusOf(s, d.Name); st.Phase != Registered {
		t.Errorf("phase %s with the endpoint down, want Registered (kept)", st.Phase)
	}

	// The driver comes back: a new socket makes kubelet register it again.
	startEndpoint(t, ep, "nfs.csi.k8s.io")
	eventually(t, 5*time.Second, "socket recreated after the restart", func() bool {
		id, _, err := statID(d.SocketPath)
		return err == nil && id != first
	})
	eventually(t, 5*time.Second, "endpoint up", func() bool { return statusOf(s, d.Name).EndpointUp })
}

// TestRestartUnderAnotherNameWithdraws: a CSI driver that comes back under another name
// must not stay registered under the configured one.
func TestRestartUnderAnotherNameWithdraws(t *testing.T) {
	dir := shortDir(t)
	ep := filepath.Join(dir, "ep", "csi.sock")
	e := startEndpoint(t, ep, "nfs.csi.k8s.io")
	d := testDriver(dir, "nfs.csi.k8s.io", config.CSIPlugin, ep)
	s := runSupervisor(t, Options{})
	s.Start(d)
	awaitSocket(t, d)
	registerAndWait(t, s, d)

	e.stop()
	startEndpoint(t, ep, "other.csi.k8s.io")
	eventually(t, 5*time.Second, "socket withdrawn", func() bool {
		_, err := os.Lstat(d.SocketPath)
		return os.IsNotExist(err)
	})
	if st := statusOf(s, d.Name); !strings.Contains(st.LastError, `reports the name "other.csi.k8s.io"`) {
		t.Errorf("last error %q, want the name mismatch", st.LastError)
	}
}

// TestStaleVerdictIgnored: while a restarted driver is probed, the old socket still serves;
// a verdict that reaches it belongs to an older generation once the new socket is out.
func TestStaleVerdictIgnored(t *testing.T) {
	dir := shortDir(t)
	ep := filepath.Join(dir, "ep", "dp.sock")
	startEndpoint(t, ep, "")
	d := testDriver(dir, "vendor.example/gpu", config.DevicePlugin, ep)
	s := runSupervisor(t, Options{})
	s.Start(d)
	awaitSocket(t, d)

	// Publish generation 2 by removing the socket; generation 1's server stops, so a late
	// verdict for it cannot arrive over the network. Deliver it as its server would.
	first := mustID(t, d.SocketPath)
	os.Remove(d.SocketPath)
	eventually(t, 5*time.Second, "generation 2", func() bool {
		id, _, err := statID(d.SocketPath)
		return err == nil && id != first
	})
	s.mu.Lock()
	h := s.running[d.Name]
	s.mu.Unlock()
	h.d.notify(verdict{gen: 1, registered: false, msg: "late"})
	registerAndWait(t, s, d)
	if st := statusOf(s, d.Name); st.Failures != 0 || st.LastError != "" {
		t.Errorf("a verdict for generation 1 counted: %+v", st)
	}
}

func TestStopRemovesSocketShutdownKeepsIt(t *testing.T) {
	dir := shortDir(t)
	ep := filepath.Join(dir, "ep", "dp.sock")
	startEndpoint(t, ep, "")
	a := testDriver(dir, "vendor.example/a", config.DevicePlugin, ep)
	b := testDriver(dir, "vendor.example/b", config.DevicePlugin, ep)

	s, err := New(Options{Log: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); s.Run(ctx) }()
	s.Start(a)
	s.Start(b)
	eventually(t, 5*time.Second, "both sockets", func() bool { return isSocket(a.SocketPath) && isSocket(b.SocketPath) })

	s.Stop(a.Name) // blocks until the loop has exited
	if _, err := os.Lstat(a.SocketPath); !os.IsNotExist(err) {
		t.Errorf("socket of a stopped driver: %v, want removed", err)
	}
	if len(s.Status()) != 1 {
		t.Errorf("status lists %d drivers after Stop, want 1", len(s.Status()))
	}
	s.Stop("unknown") // no-op

	cancel()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Run did not return within 5s")
	}
	if !isSocket(b.SocketPath) {
		t.Error("shutdown removed a socket; it must stay so kubelet keeps the plugin")
	}
	s.Start(a) // after Run: nothing
	if len(s.Status()) != 0 {
		t.Error("Start after Run started a loop")
	}
}

func TestCleanupOnExitRemovesSockets(t *testing.T) {
	dir := shortDir(t)
	ep := filepath.Join(dir, "ep", "dp.sock")
	d := testDriver(dir, "vendor.example/gpu", config.DevicePlugin, ep)
	// A stale socket from an earlier run, never replaced because the endpoint is down.
	stale := testDriver(dir, "vendor.example/stale", config.DevicePlugin, filepath.Join(dir, "ep", "none.sock"))
	if err := os.MkdirAll(filepath.Dir(stale.SocketPath), 0o750); err != nil {
		t.Fatal(err)
	}
	l, err := listenUnlinked(stale.SocketPath)
	if err != nil {
		t.Fatal(err)
	}
	l.Close() // the file stays, nothing listens: stale
	startEndpoint(t, ep, "")

	s, err := New(Options{Log: testLogger(t), CleanupOnExit: true})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); s.Run(ctx) }()
	s.Start(d)
	s.Start(stale)
	awaitSocket(t, d)
	cancel()
	<-done
	for _, p := range []string{d.SocketPath, stale.SocketPath} {
		if _, err := os.Lstat(p); !os.IsNotExist(err) {
			t.Errorf("%s after shutdown with cleanup: %v, want removed", p, err)
		}
	}
}

// The registration servers use 4 KiB transport buffers (server.go): messages larger than
// them — a PluginInfo with many versions, a long rejection from kubelet — still go through
// whole.
func TestMessagesLargerThanTheTransportBuffers(t *testing.T) {
	dir := shortDir(t)
	ep := filepath.Join(dir, "ep", "csi.sock")
	startEndpoint(t, ep, "big.csi.k8s.io")
	d := testDriver(dir, "big.csi.k8s.io", config.CSIPlugin, ep)
	d.SupportedVersions = nil
	for i := range 2000 {
		d.SupportedVersions = append(d.SupportedVersions, fmt.Sprintf("1.%d.0", i)) // ≈ 16 KiB
	}
	s := runSupervisor(t, Options{})
	s.Start(d)
	awaitSocket(t, d)

	reason := strings.Repeat("kubelet says no. ", 1000) // 17 KiB
	info := register(t, d.SocketPath, false, reason)
	if !reflect.DeepEqual(info.SupportedVersions, d.SupportedVersions) {
		t.Errorf("GetInfo returned %d versions, want all %d", len(info.SupportedVersions), len(d.SupportedVersions))
	}
	eventually(t, 5*time.Second, "the whole rejection in lastError", func() bool {
		return strings.Contains(statusOf(s, d.Name).LastError, reason)
	})
}
