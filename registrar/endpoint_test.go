package registrar

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/testkit"
)

func TestWaitsForEndpointAndWakesOnCreate(t *testing.T) {
	s, d := setupWaiting(t, config.CSIPlugin, func(d *config.Driver) {
		if err := os.MkdirAll(filepath.Dir(d.LocalEndpoint), 0o755); err != nil {
			t.Fatal(err)
		}
		// After the first failed probe the loop would wait a minute; the endpoint's Create
		// event must wake it at once.
		d.Backoff.InitialInterval = time.Minute
		d.Backoff.MaxInterval = time.Minute
	})
	testkit.Eventually(t, 5*time.Second, "WaitingForEndpoint", func() bool {
		st := statusOf(s, d.Name)
		return st.Phase == WaitingForEndpoint && strings.Contains(st.LastError, "does not accept connections")
	})
	if _, err := os.Lstat(d.SocketPath); !os.IsNotExist(err) {
		t.Fatalf("socket published before the endpoint is up: %v", err)
	}
	startEndpoint(t, d.LocalEndpoint, "nfs.csi.k8s.io")
	testkit.Eventually(t, 5*time.Second, "socket once the endpoint is up", func() bool { return testkit.IsSocket(d.SocketPath) })
}

func TestCSINameMismatch(t *testing.T) {
	dir := testkit.ShortDir(t)
	ep := filepath.Join(dir, "ep", "csi.sock")
	startEndpoint(t, ep, "smb.csi.k8s.io")
	d := testDriver(dir, "nfs.csi.k8s.io", config.CSIPlugin, ep)
	s := runSupervisor(t, Options{})
	s.Start(d)
	want := `reports the name "smb.csi.k8s.io", but the config names it "nfs.csi.k8s.io"`
	testkit.Eventually(t, 5*time.Second, "a name mismatch", func() bool {
		st := statusOf(s, d.Name)
		return st.Phase == WaitingForEndpoint && strings.Contains(st.LastError, want)
	})
	if _, err := os.Lstat(d.SocketPath); !os.IsNotExist(err) {
		t.Errorf("socket published for a driver with another name: %v", err)
	}
}

func TestEndpointRestartReregisters(t *testing.T) {
	s, d, e := setup(t, config.CSIPlugin, nil)
	awaitSocket(t, d)
	registerAndWait(t, s, d)
	first := mustID(t, d.SocketPath)

	// The driver dies: the registration stays, the endpoint shows as down.
	e.Stop()
	testkit.Eventually(t, 5*time.Second, "endpoint down", func() bool { return !statusOf(s, d.Name).EndpointUp })
	if id := mustID(t, d.SocketPath); id != first {
		t.Fatal("the registration socket changed when the endpoint went away")
	}
	if st := statusOf(s, d.Name); st.Phase != Registered {
		t.Errorf("phase %s with the endpoint down, want Registered (kept)", st.Phase)
	}

	// The driver comes back: a new socket makes kubelet register it again.
	startEndpoint(t, d.LocalEndpoint, "nfs.csi.k8s.io")
	testkit.Eventually(t, 5*time.Second, "socket recreated after the restart", func() bool {
		id, _, err := fsid.Stat(d.SocketPath)
		return err == nil && id != first
	})
	testkit.Eventually(t, 5*time.Second, "endpoint up", func() bool { return statusOf(s, d.Name).EndpointUp })
}

// TestRestartUnderAnotherNameWithdraws: a CSI driver that comes back under another name
// must not stay registered under the configured one.
func TestRestartUnderAnotherNameWithdraws(t *testing.T) {
	s, d, e := setup(t, config.CSIPlugin, nil)
	awaitSocket(t, d)
	registerAndWait(t, s, d)

	e.Stop()
	startEndpoint(t, d.LocalEndpoint, "other.csi.k8s.io")
	testkit.Eventually(t, 5*time.Second, "socket withdrawn", func() bool {
		_, err := os.Lstat(d.SocketPath)
		return os.IsNotExist(err)
	})
	if st := statusOf(s, d.Name); !strings.Contains(st.LastError, `reports the name "other.csi.k8s.io"`) {
		t.Errorf("last error %q, want the name mismatch", st.LastError)
	}
}

// TestEndpointDirectoryAppearsLater: at node boot multireg may start before the driver has
// created its directory, whose creation cannot be watched; the driver must still be picked up
// within seconds, not after the backoff interval.
func TestEndpointDirectoryAppearsLater(t *testing.T) {
	s, d := setupWaiting(t, config.CSIPlugin, func(d *config.Driver) { // ep/ does not exist yet
		d.Backoff.InitialInterval = time.Minute
		d.Backoff.MaxInterval = time.Minute
	})
	testkit.Eventually(t, 5*time.Second, "WaitingForEndpoint", func() bool { return statusOf(s, d.Name).Phase == WaitingForEndpoint })
	startEndpoint(t, d.LocalEndpoint, "nfs.csi.k8s.io") // creates the directory, then the socket
	testkit.Eventually(t, 5*time.Second, "the socket once the endpoint is up", func() bool { return testkit.IsSocket(d.SocketPath) })
}

// TestEndpointDirectoriesAppearLevelByLevel: two missing levels under the endpoint; each
// creation is seen through the nearest existing ancestor, with no poll and no backoff wait.
func TestEndpointDirectoriesAppearLevelByLevel(t *testing.T) {
	dir := testkit.ShortDir(t)
	ep := filepath.Join(dir, "a", "b", "csi.sock")
	d := testDriver(dir, "nfs.csi.k8s.io", config.CSIPlugin, ep)
	d.Backoff.InitialInterval = time.Hour
	d.Backoff.MaxInterval = time.Hour
	s := runSupervisor(t, Options{})
	s.Start(d)
	backingOff := func() bool {
		st := statusOf(s, d.Name)
		return st.LastError != "" && time.Until(st.NextAttempt) > 10*time.Minute
	}
	testkit.Eventually(t, 5*time.Second, "the first probe failed, the next in an hour", backingOff)
	testkit.Eventually(t, 5*time.Second, "a watch for a/", func() bool { return watchesFor(s, dir, "a") })
	if err := os.Mkdir(filepath.Join(dir, "a"), 0o755); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 5*time.Second, "quick probes once a/ appeared", func() bool {
		return time.Until(statusOf(s, d.Name).NextAttempt) < 2*time.Second
	})
	testkit.Eventually(t, 10*time.Second, "the quick probes over, the next in an hour again", backingOff)
	testkit.Eventually(t, 5*time.Second, "a watch for a/b/", func() bool { return watchesFor(s, filepath.Join(dir, "a"), "b") })
	startEndpoint(t, ep, "nfs.csi.k8s.io") // creates a/b/ and the socket
	testkit.Eventually(t, 5*time.Second, "the socket", func() bool { return testkit.IsSocket(d.SocketPath) })
}

// TestEndpointDirectoryRecreatedWhileServing: with waitForEndpoint false the socket is
// published at once; the endpoint's directory, missing then, is watched for through its
// ancestor, and the endpoint is reported up as soon as it exists.
func TestEndpointDirectoryRecreatedWhileServing(t *testing.T) {
	s, d := setupWaiting(t, config.DevicePlugin, func(d *config.Driver) { d.WaitForEndpoint = false })
	awaitSocket(t, d)
	if statusOf(s, d.Name).EndpointUp {
		t.Fatal("endpoint up before it exists")
	}
	startEndpoint(t, d.LocalEndpoint, "")
	testkit.Eventually(t, 5*time.Second, "the endpoint reported up", func() bool { return statusOf(s, d.Name).EndpointUp })
}

// TestEndpointUpInSharedDirectory: with waitForEndpoint false, a driver whose endpoint
// directory another loop already watches still reports its endpoint as up.
func TestEndpointUpInSharedDirectory(t *testing.T) {
	dir := testkit.ShortDir(t)
	ep1, ep2 := filepath.Join(dir, "ep", "a.sock"), filepath.Join(dir, "ep", "b.sock")
	startEndpoint(t, ep1, "")
	startEndpoint(t, ep2, "")
	a := testDriver(dir, "vendor.example/a", config.DevicePlugin, ep1)
	b := testDriver(dir, "vendor.example/b", config.DevicePlugin, ep2)
	a.WaitForEndpoint, b.WaitForEndpoint = false, false
	s := runSupervisor(t, Options{})
	s.Start(a)
	testkit.Eventually(t, 5*time.Second, "a's endpoint up", func() bool { return statusOf(s, a.Name).EndpointUp })
	s.Start(b)
	testkit.Eventually(t, 5*time.Second, "b's endpoint up", func() bool { return statusOf(s, b.Name).EndpointUp })
}

// TestEndpointChmodIsNoRestart: drivers often chmod their socket after listening; that is no
// restart and must not re-register the plugin.
func TestEndpointChmodIsNoRestart(t *testing.T) {
	s, d, _ := setup(t, config.DevicePlugin, nil)
	awaitSocket(t, d)
	registerAndWait(t, s, d)
	first := mustID(t, d.SocketPath)
	if err := os.Chmod(d.LocalEndpoint, 0o660); err != nil {
		t.Fatal(err)
	}
	testkit.Never(t, 1500*time.Millisecond, "a chmod of the endpoint re-registered the driver", func() bool {
		return mustID(t, d.SocketPath) != first || statusOf(s, d.Name).Attempts != 1
	})
	if !statusOf(s, d.Name).EndpointUp {
		t.Error("endpoint reported down after a chmod")
	}
}
