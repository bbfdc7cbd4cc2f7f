package registrar

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	csi "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/probe"
	"multireg.dev/multireg/internal/testkit"
)

// patternDriver is a resolved driver of type typ whose endpoint is dir/ep/<pattern>, as
// config resolves it (a DRA driver and a device plugin get their second registration socket).
func patternDriver(dir, typ, pattern string) config.Driver {
	n := fixtureDrivers[typ]
	d := testDriver(dir, n.name, typ, filepath.Join(dir, "ep", pattern))
	d.SetSocketPaths(filepath.Dir(d.SocketPath))
	return d
}

// startInstance serves an endpoint instance named name in the driver's endpoint directory.
func startInstance(t *testing.T, d config.Driver, name string) *servedEndpoint {
	t.Helper()
	csiName := ""
	if d.Type == config.CSIPlugin {
		csiName = d.Name
	}
	return startEndpoint(t, filepath.Join(filepath.Dir(d.LocalEndpoint), name), csiName)
}

// ageFile sets a file's modification time back by age: the newest match is the youngest file.
func ageFile(t *testing.T, path string, age time.Duration) {
	t.Helper()
	then := time.Now().Add(-age)
	if err := os.Chtimes(path, then, then); err != nil {
		t.Fatal(err)
	}
}

// TestPatternRegistersNewestAnswering: of the sockets matching the pattern, the newest that
// answers is registered under its own path; a newer socket that does not answer, a file that
// is no socket and a name that does not match are passed over.
func TestPatternRegistersNewestAnswering(t *testing.T) {
	dir := testkit.ShortDir(t)
	d := patternDriver(dir, config.DevicePlugin, "dp.*")
	epDir := filepath.Dir(d.LocalEndpoint)
	startInstance(t, d, "dp.1")
	ageFile(t, filepath.Join(epDir, "dp.1"), time.Hour)
	startInstance(t, d, "dp.2")
	ageFile(t, filepath.Join(epDir, "dp.2"), time.Minute)
	deadSocket(t, filepath.Join(epDir, "dp.3"))                                    // newest, never answers
	if err := os.WriteFile(filepath.Join(epDir, "dp.4"), nil, 0o644); err != nil { // not a socket
		t.Fatal(err)
	}
	startInstance(t, d, "other.sock") // does not match

	s := runSupervisor(t, Options{})
	s.Start(d)
	awaitSocket(t, d)
	info := register(t, d.SocketPath, true, "")
	if want := filepath.Join(epDir, "dp.2"); info.Endpoint != want {
		t.Errorf("GetInfo's endpoint %q, want the newest answering match %q", info.Endpoint, want)
	}
	testkit.Eventually(t, 5*time.Second, "Registered", func() bool { return statusOf(s, d.Name).Phase == Registered })
	if st := statusOf(s, d.Name); st.Endpoint != info.Endpoint {
		t.Errorf("status endpoint %q, want the registered %q", st.Endpoint, info.Endpoint)
	}
}

// TestNewestMatch: what a liveness check dials where no loop runs is the match a loop tries
// first: the newest socket, not a newer file that is no socket nor a name that does not match;
// "" when none matches.
func TestNewestMatch(t *testing.T) {
	dir := testkit.ShortDir(t)
	d := patternDriver(dir, config.DevicePlugin, "dp.*")
	epDir := filepath.Dir(d.LocalEndpoint)
	if err := os.MkdirAll(epDir, 0o755); err != nil {
		t.Fatal(err)
	}
	if got := NewestMatch(d); got != "" {
		t.Errorf("no match: %q, want none", got)
	}
	startInstance(t, d, "dp.1")
	ageFile(t, filepath.Join(epDir, "dp.1"), time.Hour)
	deadSocket(t, filepath.Join(epDir, "dp.2"))
	ageFile(t, filepath.Join(epDir, "dp.2"), time.Minute)
	if err := os.WriteFile(filepath.Join(epDir, "dp.3"), nil, 0o644); err != nil { // not a socket
		t.Fatal(err)
	}
	startInstance(t, d, "other.sock") // does not match
	if got, want := NewestMatch(d), filepath.Join(epDir, "dp.2"); got != want {
		t.Errorf("NewestMatch %q, want the newest socket %q", got, want)
	}
}

// TestPatternEndpointDifferentMount: endpoint and localEndpoint in different directories
// (kubelet's path and multireg's mount) with one pattern: kubelet is given the match's name in
// endpoint's directory.
func TestPatternEndpointDifferentMount(t *testing.T) {
	dir := testkit.ShortDir(t)
	d := patternDriver(dir, config.DRAPlugin, "dra-*.sock")
	d.Endpoint = "/var/lib/kubelet/plugins/gpu.example.com/dra-*.sock"
	startInstance(t, d, "dra-uid1.sock")
	runSupervisor(t, Options{}).Start(d)
	awaitSocket(t, d)
	if info := register(t, d.SocketPath, true, ""); info.Endpoint != "/var/lib/kubelet/plugins/gpu.example.com/dra-uid1.sock" {
		t.Errorf("GetInfo's endpoint %q, want kubelet's path of the match", info.Endpoint)
	}
}

// TestPatternDevicePluginFollowsRestart: a device plugin restarts under a new name (its old
// socket removed): a new registration socket names the new path.
func TestPatternDevicePluginFollowsRestart(t *testing.T) {
	dir := testkit.ShortDir(t)
	d := patternDriver(dir, config.DevicePlugin, "dp.*")
	old := startInstance(t, d, "dp.1")
	s := runSupervisor(t, Options{})
	s.Start(d)
	awaitSocket(t, d)
	registerAndWait(t, s, d)

	old.Stop()
	startInstance(t, d, "dp.2")
	// Registered in the second path, the first one removed: kubelet deregisters the one and
	// registers the other in one reconcile pass.
	testkit.Eventually(t, 5*time.Second, "a new registration socket in the second path, the first removed", func() bool {
		return testkit.IsSocket(d.AltSocketPath) && !testkit.IsSocket(d.SocketPath)
	})
	if info := register(t, d.AltSocketPath, true, ""); info.Endpoint != filepath.Join(filepath.Dir(d.LocalEndpoint), "dp.2") {
		t.Errorf("GetInfo's endpoint after the restart %q, want dp.2", info.Endpoint)
	}
	testkit.Eventually(t, 5*time.Second, "Registered again", func() bool { return statusOf(s, d.Name).Phase == Registered })
	if st := statusOf(s, d.Name); st.Recreations[ReasonEndpointRestarted] != 1 || st.Attempts != 2 {
		t.Errorf("status: %+v, want 2 attempts and one endpoint_restarted recreation", st)
	}
}

// TestPatternStaysWhileTargetAnswers: a second CSI instance appears while the registered one
// answers: nothing moves (a move would cost a re-registration). When the registered one stops
// answering, its socket file left behind as a killed process leaves it, the loop moves.
func TestPatternStaysWhileTargetAnswers(t *testing.T) {
	dir := testkit.ShortDir(t)
	d := patternDriver(dir, config.CSIPlugin, "csi-*.sock")
	epDir := filepath.Dir(d.LocalEndpoint)
	// csi-a's file stays when it stops, as a killed process leaves it: no event tells.
	aPath := filepath.Join(epDir, "csi-a.sock")
	if err := os.MkdirAll(epDir, 0o755); err != nil {
		t.Fatal(err)
	}
	la, err := testkit.ListenUnlinked(aPath)
	if err != nil {
		t.Fatal(err)
	}
	a := grpc.NewServer()
	csi.RegisterIdentityServer(a, testkit.Identity{Name: d.Name})
	go a.Serve(la)
	t.Cleanup(a.Stop)
	s := runSupervisor(t, Options{})
	s.Start(d)
	awaitSocket(t, d)
	registerAndWait(t, s, d)
	first := mustID(t, d.SocketPath)

	startInstance(t, d, "csi-b.sock")
	testkit.Never(t, time.Second, "the registration socket replaced while its endpoint answers", func() bool {
		id, _, err := fsid.Stat(d.SocketPath)
		return err != nil || id != first
	})

	a.Stop() // killed: the file stays, nothing listens
	if !testkit.IsSocket(aPath) {
		t.Fatal("csi-a's socket file went with its process")
	}
	testkit.Eventually(t, 10*time.Second, "a new registration socket for csi-b", func() bool {
		id, _, err := fsid.Stat(d.SocketPath)
		return err == nil && id != first
	})
	if info := register(t, d.SocketPath, true, ""); info.Endpoint != filepath.Join(epDir, "csi-b.sock") {
		t.Errorf("GetInfo's endpoint %q, want csi-b", info.Endpoint)
	}
}

// registeredDRAPattern starts a DRA driver named by the pattern dra-*.sock, with one instance,
// dra-a.sock (a minute old, so that a later instance is newer), and plays kubelet registering
// it. It returns the instance.
func registeredDRAPattern(t *testing.T, opts Options) (*Supervisor, config.Driver, *servedEndpoint) {
	t.Helper()
	d := patternDriver(testkit.ShortDir(t), config.DRAPlugin, "dra-*.sock")
	a := startInstance(t, d, "dra-a.sock")
	ageFile(t, a.Path(), time.Minute)
	s := runSupervisor(t, opts)
	s.Start(d)
	awaitSocket(t, d)
	registerAndWait(t, s, d)
	return s, d, a
}

// TestPatternDRARollover: a DRA driver's new instance appears beside the registered one: it is
// registered through the second socket while the first stays untouched, and the first is
// withdrawn only once the new one is registered and the old instance is gone. kubelet always
// holds a registration.
func TestPatternDRARollover(t *testing.T) {
	var log testkit.Buffer
	s, d, a := registeredDRAPattern(t, Options{Log: log.Logger()})
	epDir := filepath.Dir(d.LocalEndpoint)
	first := mustID(t, d.SocketPath)
	unchanged := func() bool { id, _, err := fsid.Stat(d.SocketPath); return err == nil && id == first }

	startInstance(t, d, "dra-b.sock")
	testkit.Eventually(t, 5*time.Second, "the second registration socket", func() bool { return testkit.IsSocket(d.AltSocketPath) })
	if !unchanged() {
		t.Fatal("the registered socket moved when the new instance appeared")
	}
	if st := statusOf(s, d.Name); st.Phase != Registered || !st.Ready() {
		t.Errorf("while the new instance is being registered: %+v, want Registered (kubelet holds the old one)", st)
	}
	if info := register(t, d.AltSocketPath, true, ""); info.Endpoint != filepath.Join(epDir, "dra-b.sock") {
		t.Errorf("the second socket's endpoint %q, want dra-b", info.Endpoint)
	}
	testkit.Eventually(t, 5*time.Second, "Registered on the second socket", func() bool {
		st := statusOf(s, d.Name)
		return st.Phase == Registered && st.Socket == d.AltSocketPath
	})
	testkit.Never(t, 500*time.Millisecond, "the old registration withdrawn while the old instance runs", func() bool { return !unchanged() })

	a.Stop()
	testkit.Eventually(t, 5*time.Second, "the old registration withdrawn", func() bool { return !testkit.IsSocket(d.SocketPath) })
	if !testkit.IsSocket(d.AltSocketPath) {
		t.Error("the new registration socket went too")
	}
	if st := statusOf(s, d.Name); st.Phase != Registered || st.Endpoint != filepath.Join(epDir, "dra-b.sock") || st.Recreations[ReasonEndpointRestarted] != 0 {
		t.Errorf("status after the rollover: %+v, want Registered on dra-b, no recreation", st)
	}
	if !strings.Contains(log.String(), "withdrawing the old registration") {
		t.Errorf("the withdrawal was not logged:\n%s", log.String())
	}
}

// TestPatternDRANewInstanceDuringRegistration: a DRA driver's new instance answers after
// kubelet asked the first socket's GetInfo and before its verdict: kubelet may hold that
// registration already, so the socket stays, and the new instance is registered beside it
// once the verdict is in (moving at once would withdraw a registration kubelet may have just
// made: a second without any).
func TestPatternDRANewInstanceDuringRegistration(t *testing.T) {
	var log testkit.Buffer
	d := patternDriver(testkit.ShortDir(t), config.DRAPlugin, "dra-*.sock")
	a := startInstance(t, d, "dra-a.sock")
	ageFile(t, a.Path(), time.Minute)
	s := runSupervisor(t, Options{Log: log.Logger()})
	s.Start(d)
	awaitSocket(t, d)
	first := mustID(t, d.SocketPath)
	unchanged := func() bool { id, _, err := fsid.Stat(d.SocketPath); return err == nil && id == first }

	k := dialKubelet(t, d.SocketPath)
	if info := k.GetInfo(t); info.Endpoint != a.Path() {
		t.Fatalf("GetInfo's endpoint %q, want dra-a", info.Endpoint)
	}
	b := startInstance(t, d, "dra-b.sock")
	testkit.Eventually(t, 5*time.Second, "the newer instance seen", func() bool {
		return strings.Contains(log.String(), "registered beside this one once kubelet's verdict") || !unchanged()
	})
	if !unchanged() || testkit.IsSocket(d.AltSocketPath) {
		t.Fatalf("sockets before kubelet's verdict: first unchanged %v, second there %v; want the first alone, untouched", unchanged(), testkit.IsSocket(d.AltSocketPath))
	}

	k.Notify(t, true, "")
	testkit.Eventually(t, 5*time.Second, "the second registration socket", func() bool { return testkit.IsSocket(d.AltSocketPath) })
	if !unchanged() {
		t.Fatal("the socket kubelet registered moved when the new instance was taken up")
	}
	if info := register(t, d.AltSocketPath, true, ""); info.Endpoint != b.Path() {
		t.Errorf("the second socket's endpoint %q, want dra-b", info.Endpoint)
	}
	testkit.Eventually(t, 5*time.Second, "Registered on the second socket", func() bool {
		st := statusOf(s, d.Name)
		return st.Phase == Registered && st.Socket == d.AltSocketPath
	})
	if st := statusOf(s, d.Name); st.Recreations[ReasonEndpointRestarted] != 0 {
		t.Errorf("status: %+v, want no recreation", st)
	}
}

// TestPatternDRARolloverRejected: kubelet rejects the new instance's registration: the old
// registration stays, and the next attempt goes to the second socket again.
func TestPatternDRARolloverRejected(t *testing.T) {
	_, d, _ := registeredDRAPattern(t, Options{})
	first := mustID(t, d.SocketPath)

	startInstance(t, d, "dra-b.sock")
	testkit.Eventually(t, 5*time.Second, "the second registration socket", func() bool { return testkit.IsSocket(d.AltSocketPath) })
	second := mustID(t, d.AltSocketPath)
	register(t, d.AltSocketPath, false, "no")
	testkit.Eventually(t, 5*time.Second, "another attempt on the second socket", func() bool {
		id, _, err := fsid.Stat(d.AltSocketPath)
		return err == nil && id != second
	})
	if id := mustID(t, d.SocketPath); id != first {
		t.Error("the registered socket moved after the new instance was rejected")
	}
}

// rolledOver is a DRA pattern driver, on a supervisor of opts, after a rollover: dra-a still
// runs, its registration kept on the first socket, and dra-b registered on the second.
func rolledOver(t *testing.T, opts Options) (*Supervisor, config.Driver, *servedEndpoint, *servedEndpoint) {
	t.Helper()
	s, d, a := registeredDRAPattern(t, opts)
	b := startInstance(t, d, "dra-b.sock")
	testkit.Eventually(t, 5*time.Second, "the second registration socket", func() bool { return testkit.IsSocket(d.AltSocketPath) })
	register(t, d.AltSocketPath, true, "")
	testkit.Eventually(t, 5*time.Second, "Registered on the second socket", func() bool {
		st := statusOf(s, d.Name)
		return st.Phase == Registered && st.Socket == d.AltSocketPath
	})
	return s, d, a, b
}

// TestPatternDRANewInstanceGoes: the new instance goes while the old one runs: its
// registration is withdrawn and the loop is back on the old one's, which is left alone.
func TestPatternDRANewInstanceGoes(t *testing.T) {
	s, d, a, b := rolledOver(t, Options{})
	first := mustID(t, d.SocketPath)
	b.Stop()
	testkit.Eventually(t, 5*time.Second, "the new instance's registration withdrawn", func() bool { return !testkit.IsSocket(d.AltSocketPath) })
	testkit.Never(t, time.Second, "the old instance's registration touched", func() bool {
		id, _, err := fsid.Stat(d.SocketPath)
		return err != nil || id != first || testkit.IsSocket(d.AltSocketPath)
	})
	if st := statusOf(s, d.Name); st.Phase != Registered || st.Socket != d.SocketPath || st.Endpoint != a.Path() {
		t.Errorf("status: %+v, want Registered on the first socket, at dra-a", st)
	}
}

// TestPatternDRANewInstanceRejectedAndGone: kubelet rejects the new instance, which then goes:
// the old instance is registered already, and no second socket is published for it (kubelet
// would refuse a second registration of one endpoint).
func TestPatternDRANewInstanceRejectedAndGone(t *testing.T) {
	s, d, a := registeredDRAPattern(t, Options{})
	first := mustID(t, d.SocketPath)
	b := startInstance(t, d, "dra-b.sock")
	testkit.Eventually(t, 5*time.Second, "the second registration socket", func() bool { return testkit.IsSocket(d.AltSocketPath) })
	register(t, d.AltSocketPath, false, "no")
	b.Stop()
	testkit.Never(t, time.Second, "a second registration of the old instance", func() bool {
		id, _, err := fsid.Stat(d.SocketPath)
		return testkit.IsSocket(d.AltSocketPath) || err != nil || id != first
	})
	if st := statusOf(s, d.Name); st.Phase != Registered || st.Socket != d.SocketPath || st.Endpoint != a.Path() {
		t.Errorf("status: %+v, want Registered on the first socket, at dra-a", st)
	}
}

// TestPatternDRARolloverBlocked: something that is not a socket at the second registration
// socket's path is never touched: the rollover backs off (the old registration stays, and so
// does the driver's readiness) and goes on as soon as the path is clear.
func TestPatternDRARolloverBlocked(t *testing.T) {
	s, d, _ := registeredDRAPattern(t, Options{})
	if err := os.Mkdir(d.AltSocketPath, 0o755); err != nil {
		t.Fatal(err)
	}

	startInstance(t, d, "dra-b.sock")
	testkit.Eventually(t, 5*time.Second, "the blocked path reported", func() bool {
		return strings.Contains(statusOf(s, d.Name).LastError, d.AltSocketPath)
	})
	testkit.Never(t, time.Second, "the driver to stop being ready while the old registration stays", func() bool {
		return !statusOf(s, d.Name).Ready() || !testkit.IsSocket(d.SocketPath)
	})
	if n := statusOf(s, d.Name).Attempts; n > 20 {
		t.Errorf("%d attempts within a second: the loop spins on the blocked path instead of backing off", n)
	}
	if err := os.Remove(d.AltSocketPath); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 5*time.Second, "the second socket once the path is clear", func() bool { return testkit.IsSocket(d.AltSocketPath) })
}

// TestPatternDRAVerdictOfAnInstanceGoneMeanwhile: kubelet rejects the new instance while the
// loop is still looking at its going: the loop goes back to the old instance's registration,
// and the rejection, about a socket withdrawn since, does not end that registration.
func TestPatternDRAVerdictOfAnInstanceGoneMeanwhile(t *testing.T) {
	d := patternDriver(testkit.ShortDir(t), config.DRAPlugin, "dra-*.sock")
	a := startInstance(t, d, "dra-a.sock")
	ageFile(t, a.Path(), time.Minute)
	// A probe of dra-a, once armed, waits until the test lets it go: the loop is held in
	// its look at the new instance's going.
	var armed atomic.Bool
	entered, release := make(chan struct{}), make(chan struct{})
	s := runSupervisor(t, Options{})
	s.env.probe = func(ctx context.Context, spec config.Driver) error {
		if spec.LocalEndpoint == a.Path() && armed.CompareAndSwap(true, false) {
			close(entered)
			<-release
		}
		return probe.Endpoint(ctx, spec)
	}
	s.Start(d)
	awaitSocket(t, d)
	registerAndWait(t, s, d)
	first := mustID(t, d.SocketPath)
	b := startInstance(t, d, "dra-b.sock")
	testkit.Eventually(t, 5*time.Second, "the second registration socket", func() bool { return testkit.IsSocket(d.AltSocketPath) })

	armed.Store(true)
	b.Stop()
	<-entered
	register(t, d.AltSocketPath, false, "no")
	close(release)
	testkit.Eventually(t, 5*time.Second, "the new instance's socket withdrawn", func() bool { return !testkit.IsSocket(d.AltSocketPath) })
	testkit.Never(t, time.Second, "the old instance's registration touched", func() bool {
		id, _, err := fsid.Stat(d.SocketPath)
		return testkit.IsSocket(d.AltSocketPath) || err != nil || id != first
	})
	if st := statusOf(s, d.Name); st.Phase != Registered || st.Socket != d.SocketPath || st.Endpoint != a.Path() {
		t.Errorf("status: %+v, want Registered on the first socket, at dra-a", st)
	}
}
