package registrar

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	drahealthv1 "k8s.io/kubelet/pkg/apis/dra-health/v1"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/testkit"
)

// TestDRAAdvertisesTheHealthItServes: with the default versions, a DRA driver's GetInfo lists
// the health services its endpoint serves after them, however soon it answers; with versions
// of its own that name one, exactly those.
func TestDRAAdvertisesTheHealthItServes(t *testing.T) {
	defaults := config.DefaultVersions(config.DRAPlugin)
	for _, tt := range []struct {
		name   string
		set    []string
		serves []string
		delay  time.Duration
		want   []string
	}{
		{"none served", nil, nil, 0, defaults},
		{"none served, answering slowly", nil, nil, time.Second, defaults},
		{"v1alpha1 served", nil, []string{"v1alpha1"}, 0, append(slices.Clone(defaults), "v1alpha1.DRAResourceHealth")},
		{"v1alpha1 served, answering slowly", nil, []string{"v1alpha1"}, time.Second, append(slices.Clone(defaults), "v1alpha1.DRAResourceHealth")},
		{"both served", nil, []string{"v1", "v1alpha1"}, 0, append(slices.Clone(defaults), "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")},
		{"set by the user", []string{"v1.DRAPlugin", "v1alpha1.DRAResourceHealth"}, []string{"v1"}, 0, []string{"v1.DRAPlugin", "v1alpha1.DRAResourceHealth"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := testkit.ShortDir(t)
			d := testDriver(dir, "gpu.example.com", config.DRAPlugin, filepath.Join(dir, "ep", "dra.sock"))
			if tt.set != nil {
				d.SupportedVersions = tt.set
			}
			testkit.HealthEndpointWith(t, d.LocalEndpoint, testkit.HealthOptions{Services: tt.serves, Delay: tt.delay})
			s := runSupervisor(t, Options{})
			s.Start(d)
			awaitSocket(t, d)
			if got := register(t, d.SocketPath, true, "").GetSupportedVersions(); !slices.Equal(got, tt.want) {
				t.Errorf("GetInfo's supportedVersions = %q, want %q", got, tt.want)
			}
		})
	}
}

// TestDRARestartWithHealthReregisters: a registered DRA driver that restarts keeps its
// registration, unless it now serves other health services than kubelet was told: kubelet
// learns them only from a new registration.
func TestDRARestartWithHealthReregisters(t *testing.T) {
	var log testkit.Buffer
	dir := testkit.ShortDir(t)
	d := testDriver(dir, "gpu.example.com", config.DRAPlugin, filepath.Join(dir, "ep", "dra.sock"))
	e := testkit.HealthEndpoint(t, d.LocalEndpoint)
	s := runSupervisor(t, Options{Log: log.Logger()})
	s.Start(d)
	awaitSocket(t, d)
	registerAndWait(t, s, d)
	first := mustID(t, d.SocketPath)

	// The same services after a restart: the registration stays.
	crash(t, s, d, e)
	e = testkit.HealthEndpoint(t, d.LocalEndpoint)
	testkit.Eventually(t, 5*time.Second, "the restart kept", func() bool { return strings.Contains(log.String(), kept) })
	if id := mustID(t, d.SocketPath); id != first {
		t.Fatal("the registration socket replaced after a restart with the same health services")
	}

	// An upgrade that serves health: registered again, advertising it.
	crash(t, s, d, e)
	testkit.HealthEndpoint(t, d.LocalEndpoint, "v1")
	testkit.Eventually(t, 5*time.Second, "a new registration socket", func() bool {
		id, _, err := fsid.Stat(d.SocketPath)
		return err == nil && id != first
	})
	want := append(slices.Clone(d.SupportedVersions), "v1.DRAResourceHealth")
	if got := register(t, d.SocketPath, true, "").GetSupportedVersions(); !slices.Equal(got, want) {
		t.Errorf("GetInfo after the upgrade: %q, want %q", got, want)
	}
	if st := statusOf(s, d.Name); st.Recreations[ReasonEndpointRestarted] != 1 {
		t.Errorf("recreations: %v, want endpoint_restarted 1", st.Recreations)
	}
}

// kept is what the loop logs when a registered DRA driver's restart leaves its registration.
const kept = "driver endpoint restarted; kubelet reconnects to it by itself, the registration stays"

// registeredDRA starts a DRA driver whose endpoint o describes, on a supervisor logging into
// log, registers it, checks that kubelet was told the driver's versions and then want's health
// services, and returns the endpoint and its registration socket.
func registeredDRA(t *testing.T, log *testkit.Buffer, o testkit.HealthOptions, want ...string) (*Supervisor, config.Driver, *servedEndpoint, fsid.ID) {
	t.Helper()
	dir := testkit.ShortDir(t)
	d := testDriver(dir, "gpu.example.com", config.DRAPlugin, filepath.Join(dir, "ep", "dra.sock"))
	e := testkit.HealthEndpointWith(t, d.LocalEndpoint, o)
	s := runSupervisor(t, Options{Log: log.Logger()})
	s.Start(d)
	awaitSocket(t, d)
	if got, want := register(t, d.SocketPath, true, "").GetSupportedVersions(), slices.Concat(d.SupportedVersions, want); !slices.Equal(got, want) {
		t.Fatalf("GetInfo's supportedVersions = %q, want %q", got, want)
	}
	testkit.Eventually(t, 5*time.Second, d.Name+" Registered", func() bool { return statusOf(s, d.Name).Phase == Registered })
	return s, d, e, mustID(t, d.SocketPath)
}

// TestDRARestartSlowOrFastKeepsRegistration: a DRA driver serving only v1alpha1 restarts into
// the same release again and again, answering NodeWatchResources (v1's Unimplemented, v1alpha1's
// message) a second late or at once in turn: kubelet was told the same services every time, so
// the registration socket is never replaced, and kubelet sees one registration.
func TestDRARestartSlowOrFastKeepsRegistration(t *testing.T) {
	var log testkit.Buffer
	slow := testkit.HealthOptions{Services: []string{"v1alpha1"}, Delay: time.Second}
	fast := testkit.HealthOptions{Services: []string{"v1alpha1"}}
	s, d, e, first := registeredDRA(t, &log, slow, "v1alpha1.DRAResourceHealth")
	const restarts = 4
	for i := 1; i <= restarts; i++ {
		crash(t, s, d, e)
		o := fast
		if i%2 == 0 {
			o = slow
		}
		e = testkit.HealthEndpointWith(t, d.LocalEndpoint, o)
		testkit.Eventually(t, 10*time.Second, fmt.Sprintf("restart %d kept", i), func() bool { return strings.Count(log.String(), kept) == i })
		if id := mustID(t, d.SocketPath); id != first {
			t.Fatalf("restart %d (answering after %s) replaced the registration socket", i, o.Delay)
		}
	}
	st := statusOf(s, d.Name)
	if st.Phase != Registered || st.Attempts != 1 || st.Results[ResultRegistered] != 1 || st.Recreations[ReasonEndpointRestarted] != 0 || st.EndpointRestarts != restarts {
		t.Errorf("status after %d restarts: %+v, want Registered, 1 attempt, 1 registration, no recreation, %d endpoint restarts", restarts, st, restarts)
	}
}

// restartSilent starts the DRA driver d again, crashed, as one that says nothing within the
// probe's bound, and checks that its registration socket (first) stays and kubelet is told
// the v1alpha1 health service it answered before.
func restartSilent(t *testing.T, d config.Driver, log *testkit.Buffer, first fsid.ID) {
	t.Helper()
	testkit.HealthEndpointWith(t, d.LocalEndpoint, testkit.HealthOptions{Services: []string{"v1alpha1"}, Delay: time.Hour})
	testkit.Eventually(t, 10*time.Second, "the restart kept", func() bool { return strings.Contains(log.String(), kept) })
	if id := mustID(t, d.SocketPath); id != first {
		t.Fatal("the registration socket replaced after a restart that answered nothing")
	}
	want := append(slices.Clone(d.SupportedVersions), "v1alpha1.DRAResourceHealth")
	if got := dialKubelet(t, d.SocketPath).GetInfo(t).GetSupportedVersions(); !slices.Equal(got, want) {
		t.Errorf("GetInfo after the silent restart: %q, want %q", got, want)
	}
}

// TestDRARestartSilenceKeepsHealth: a DRA driver that answered v1alpha1 served and v1 not
// restarts into one that says nothing within the probe's bound: its earlier answer stands, the
// registration stays, and kubelet is told the same services. The log says why.
func TestDRARestartSilenceKeepsHealth(t *testing.T) {
	var log testkit.Buffer
	s, d, e, first := registeredDRA(t, &log, testkit.HealthOptions{Services: []string{"v1alpha1"}}, "v1alpha1.DRAResourceHealth")
	crash(t, s, d, e)
	restartSilent(t, d, &log, first)
	const keeping = "no answer to NodeWatchResources within the probe's bound; keeping what the driver answered before"
	if n := strings.Count(log.String(), keeping); n != 2 {
		t.Errorf("logged %q %d times, want once for each service:\n%s", keeping, n, log.String())
	}
}

// TestDRASilentHealthAdvertised: a DRA driver whose v1 stream stays open without a word, first
// asked, is advertised with v1: a handler runs. The log says that silence decided.
func TestDRASilentHealthAdvertised(t *testing.T) {
	var log testkit.Buffer
	registeredDRA(t, &log, testkit.HealthOptions{Services: []string{"v1-quiet"}}, "v1.DRAResourceHealth")
	const taken = "no answer to NodeWatchResources within the probe's bound, and none before; taken as served"
	if n := strings.Count(log.String(), taken); n != 1 {
		t.Errorf("logged %q %d times, want once (v1):\n%s", taken, n, log.String())
	}
}

// TestHandOverAsksNoHealth: a hand-over tells the next instance which health services a DRA
// driver's socket advertises: the next instance asks the endpoint nothing (kubelet and the
// driver see nothing), and its GetInfo answers what kubelet was told. A restart of the driver
// afterwards is asked again.
func TestHandOverAsksNoHealth(t *testing.T) {
	dir := testkit.ShortDir(t)
	reg := filepath.Join(dir, "reg")
	d := testDriver(dir, "gpu.example.com", config.DRAPlugin, filepath.Join(dir, "ep", "dra.sock"))
	calls := new(atomic.Int32)
	serve := func() *servedEndpoint {
		return serveEndpoint(t, d.LocalEndpoint, func(srv *grpc.Server) {
			drahealthv1.RegisterDRAResourceHealthServer(srv, testkit.HealthV1{Send: true, Calls: calls})
		})
	}
	e := serve()
	a := startMultireg(t, reg, []config.Driver{d})
	awaitSocket(t, d)
	registerAndWait(t, a.sup, d)
	asked := calls.Load()
	if asked != 1 {
		t.Fatalf("NodeWatchResources asked %d times before the registration, want 1", asked)
	}

	b := startMultireg(t, reg, []config.Driver{d})
	if b.sup.TakenOver() != 1 {
		t.Fatal("the socket was not taken over")
	}
	testkit.Eventually(t, 5*time.Second, "Registered in the new instance", func() bool { return statusOf(b.sup, d.Name).Phase == Registered })
	testkit.Never(t, 500*time.Millisecond, "the endpoint asked again after the hand-over", func() bool { return calls.Load() != asked })
	want := append(slices.Clone(d.SupportedVersions), "v1.DRAResourceHealth")
	if got := dialKubelet(t, d.SocketPath).GetInfo(t).GetSupportedVersions(); !slices.Equal(got, want) {
		t.Errorf("the new instance's GetInfo: %q, want %q", got, want)
	}

	crash(t, b.sup, d, e)
	serve()
	testkit.Eventually(t, 5*time.Second, "the restarted driver asked", func() bool { return calls.Load() > asked })
}

// TestHandOverSilenceKeepsHealth: what a hand-over tells of a DRA driver's health services is
// an answer the next instance keeps when the restarted driver says nothing within the probe's
// bound: the registration stays.
func TestHandOverSilenceKeepsHealth(t *testing.T) {
	dir := testkit.ShortDir(t)
	reg := filepath.Join(dir, "reg")
	d := testDriver(dir, "gpu.example.com", config.DRAPlugin, filepath.Join(dir, "ep", "dra.sock"))
	e := testkit.HealthEndpoint(t, d.LocalEndpoint, "v1alpha1")
	a := startMultireg(t, reg, []config.Driver{d})
	awaitSocket(t, d)
	registerAndWait(t, a.sup, d)
	var log testkit.Buffer
	b := startMultiregLog(t, reg, []config.Driver{d}, log.Logger())
	if b.sup.TakenOver() != 1 {
		t.Fatal("the socket was not taken over")
	}
	testkit.Eventually(t, 5*time.Second, "Registered in the new instance", func() bool { return statusOf(b.sup, d.Name).Phase == Registered })
	first := mustID(t, d.SocketPath)

	crash(t, b.sup, d, e)
	restartSilent(t, d, &log, first)
}

// TestBadDRADriversDelayNoOther: 300 DRA drivers whose device health answer hangs (half of
// them: their endpoint serves gRPC and says nothing) or whose endpoint speaks no HTTP/2 at all
// (the other half: it accepts and is silent) start beside 10 that answer at once, after them
// in the file: each bad one's question takes the probe's whole bound (2 s), and none delays a
// good one's registration. (When the questions took the 32 places of the endpoint probes, the
// good ones waited for the bad ones' questions and retries: 6.1 s here with -race, 19-20 s on
// a node; 0.4 s since.) The time the good ones took is logged.
func TestBadDRADriversDelayNoOther(t *testing.T) {
	dir := testkit.ShortDir(t)
	var bad, good []config.Driver
	for i := range 300 {
		d := testDriver(dir, fmt.Sprintf("bad%d.example.com", i), config.DRAPlugin, filepath.Join(dir, "ep", fmt.Sprintf("b%d.sock", i)))
		if i%2 == 0 {
			testkit.HealthEndpointWith(t, d.LocalEndpoint, testkit.HealthOptions{Services: []string{"v1"}, Delay: time.Hour})
		} else {
			silentListener(t, d.LocalEndpoint)
		}
		bad = append(bad, d)
	}
	for i := range 10 {
		d := testDriver(dir, fmt.Sprintf("good%d.example.com", i), config.DRAPlugin, filepath.Join(dir, "ep", fmt.Sprintf("g%d.sock", i)))
		testkit.HealthEndpoint(t, d.LocalEndpoint, "v1")
		good = append(good, d)
	}
	s := runSupervisor(t, Options{})
	start := time.Now()
	for _, d := range slices.Concat(bad, good) {
		s.Start(d)
	}
	testkit.Eventually(t, 3*time.Second, "the good drivers' sockets published", func() bool {
		return !slices.ContainsFunc(good, func(d config.Driver) bool { return !testkit.IsSocket(d.SocketPath) })
	})
	t.Logf("the 10 good drivers' sockets published %s after the start, beside 300 bad ones", time.Since(start).Round(time.Millisecond))
	for _, d := range good {
		if got := register(t, d.SocketPath, true, "").GetSupportedVersions(); !slices.Contains(got, "v1.DRAResourceHealth") {
			t.Errorf("%s advertised %q, want its health service", d.Name, got)
		}
	}
}

// silentListener accepts connections at path and says nothing on them: no HTTP/2, no gRPC.
func silentListener(t *testing.T, path string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	var conns []net.Conn
	var mu sync.Mutex
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		l.Close()
		<-done
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
	})
}
