package registrar

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/regserver"
	"multireg.dev/multireg/internal/testkit"
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
	s, d, _ := setup(t, config.CSIPlugin, func(d *config.Driver) {
		d.Endpoint = "/var/lib/kubelet/plugins/nfs/csi.sock" // what kubelet dials differs from what multireg sees
	})

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
	testkit.Eventually(t, 5*time.Second, "Serving, endpoint up, 1 attempt before the verdict", func() bool {
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
	testkit.Eventually(t, 5*time.Second, "Registered", func() bool { return statusOf(s, d.Name).Phase == Registered })

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
	s, d, _ := setup(t, config.DRAPlugin, nil)

	awaitSocket(t, d)
	first := mustID(t, d.SocketPath)
	register(t, d.SocketPath, false, "RegisterPlugin error -- plugin registration failed with err: boom")

	// A new generation replaces the rejected one after the backoff interval.
	testkit.Eventually(t, 5*time.Second, "a new socket", func() bool {
		id, _, err := fsid.Stat(d.SocketPath)
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
	s, d, _ := setup(t, config.DevicePlugin, func(d *config.Driver) {
		d.Backoff.InitialInterval = time.Minute // stays in BackingOff for the test
		d.Backoff.MaxInterval = time.Minute
	})
	awaitSocket(t, d)
	register(t, d.SocketPath, false, "no")
	testkit.Eventually(t, 5*time.Second, "BackingOff", func() bool { return statusOf(s, d.Name).Phase == BackingOff })
	if _, err := os.Lstat(d.SocketPath); !os.IsNotExist(err) {
		t.Errorf("socket during backoff: %v, want it removed", err)
	}
	st := statusOf(s, d.Name)
	if wait := time.Until(st.NextAttempt); wait < 30*time.Second || wait > 90*time.Second {
		t.Errorf("next attempt in %s, want about a minute (±20%%)", wait)
	}
}

func TestDeletedSocketIsRecreated(t *testing.T) {
	s, d, _ := setup(t, config.CSIPlugin, func(d *config.Driver) {
		d.Backoff.InitialInterval = time.Minute // recreation must not wait for a backoff
		d.Backoff.MaxInterval = time.Minute
	})
	awaitSocket(t, d)
	registerAndWait(t, s, d)

	if err := os.Remove(d.SocketPath); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, time.Second, "socket recreated within 1s", func() bool { return testkit.IsSocket(d.SocketPath) })
	testkit.Eventually(t, 5*time.Second, "Serving, 2 attempts after the recreation", func() bool {
		st := statusOf(s, d.Name)
		return st.Phase == Serving && st.Attempts == 2
	})
	register(t, d.SocketPath, true, "")
	testkit.Eventually(t, 5*time.Second, "Registered again", func() bool { return statusOf(s, d.Name).Phase == Registered })
}

func TestRegistrationDirectoryRecreated(t *testing.T) {
	_, d, _ := setup(t, config.DevicePlugin, nil)
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
	testkit.Eventually(t, time.Second, "socket recreated within 1s", func() bool {
		id, _, err := fsid.Stat(d.SocketPath)
		return err == nil && id != first
	})
	// The new directory is watched: deleting the new socket is noticed too.
	second := mustID(t, d.SocketPath)
	if err := os.Remove(d.SocketPath); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, time.Second, "socket recreated again", func() bool {
		id, _, err := fsid.Stat(d.SocketPath)
		return err == nil && id != second
	})
}

func TestRegistrationTimeoutRecreates(t *testing.T) {
	s, d, _ := setup(t, config.DevicePlugin, func(d *config.Driver) { d.RegistrationTimeout = time.Second })
	awaitSocket(t, d)
	first := mustID(t, d.SocketPath)
	testkit.Eventually(t, 5*time.Second, "socket recreated after the timeout", func() bool {
		id, _, err := fsid.Stat(d.SocketPath)
		return err == nil && id != first
	})
	st := statusOf(s, d.Name)
	if st.Failures < 1 || !strings.Contains(st.LastError, "no registration verdict from kubelet within 1s") {
		t.Errorf("status after a timeout: %+v", st)
	}
	// Once registered, the timeout no longer applies.
	registerAndWait(t, s, d)
	registered := mustID(t, d.SocketPath)
	testkit.Never(t, 1500*time.Millisecond, "a registered socket recreated by the timeout", func() bool {
		return mustID(t, d.SocketPath) != registered
	})
}

// TestSlowRegistrationCompletes: kubelet's registration of the plugin takes longer than
// registrationTimeout (a slow NodeGetInfo). Each timeout lets the next attempt wait longer,
// so the driver ends Registered; the registration brings the timeout back to the configured
// one.
func TestSlowRegistrationCompletes(t *testing.T) {
	s, d, _ := setup(t, config.DevicePlugin, func(d *config.Driver) { d.RegistrationTimeout = time.Second })
	stop := runSlowKubelet(t, d.SocketPath, 1500*time.Millisecond)
	testkit.Eventually(t, 20*time.Second, "Registered although kubelet takes 1.5s", func() bool { return statusOf(s, d.Name).Phase == Registered })
	if st := statusOf(s, d.Name); st.Results[ResultTimeout] < 1 {
		t.Errorf("registered without a timeout first: %+v", st)
	}
	stop()

	// A new socket that nobody answers times out after the configured timeout again.
	if err := os.Remove(d.SocketPath); err != nil {
		t.Fatal(err)
	}
	const want = "no registration verdict from kubelet within 1s; the next attempt allows 2s"
	testkit.Eventually(t, 5*time.Second, "a timeout after the configured 1s", func() bool { return statusOf(s, d.Name).LastError == want })
}

// TestStaleVerdictIgnored: while a restarted driver is probed, the old socket still serves;
// a verdict that reaches it belongs to an older generation once the new socket is out.
func TestStaleVerdictIgnored(t *testing.T) {
	s, d, _ := setup(t, config.DevicePlugin, nil)
	awaitSocket(t, d)

	// Publish generation 2 by removing the socket; generation 1's server stops, so a late
	// verdict for it cannot arrive over the network. Deliver it as its server would.
	first := mustID(t, d.SocketPath)
	os.Remove(d.SocketPath)
	testkit.Eventually(t, 5*time.Second, "generation 2", func() bool {
		id, _, err := fsid.Stat(d.SocketPath)
		return err == nil && id != first
	})
	s.mu.Lock()
	h := s.running[d.Name]
	s.mu.Unlock()
	h.d.notify(regserver.Verdict{Gen: 1, Registered: false, Msg: "late"})
	registerAndWait(t, s, d)
	if st := statusOf(s, d.Name); st.Failures != 0 || st.LastError != "" {
		t.Errorf("a verdict for generation 1 counted: %+v", st)
	}
}
