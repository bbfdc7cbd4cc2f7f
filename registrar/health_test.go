package registrar

import (
	"path/filepath"
	"slices"
	"strings"
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
// the health services its endpoint serves after them; with versions of its own that name one,
// exactly those.
func TestDRAAdvertisesTheHealthItServes(t *testing.T) {
	defaults := config.DefaultVersions(config.DRAPlugin)
	for _, tt := range []struct {
		name   string
		set    []string
		serves []string
		want   []string
	}{
		{"none served", nil, nil, defaults},
		{"v1alpha1 served", nil, []string{"v1alpha1"}, append(slices.Clone(defaults), "v1alpha1.DRAResourceHealth")},
		{"both served", nil, []string{"v1", "v1alpha1"}, append(slices.Clone(defaults), "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")},
		{"set by the user", []string{"v1.DRAPlugin", "v1alpha1.DRAResourceHealth"}, []string{"v1"}, []string{"v1.DRAPlugin", "v1alpha1.DRAResourceHealth"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := testkit.ShortDir(t)
			d := testDriver(dir, "gpu.example.com", config.DRAPlugin, filepath.Join(dir, "ep", "dra.sock"))
			if tt.set != nil {
				d.SupportedVersions = tt.set
			}
			testkit.HealthEndpoint(t, d.LocalEndpoint, tt.serves...)
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
	const kept = "driver endpoint restarted; kubelet reconnects to it by itself, the registration stays"
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

// TestHandOverAsksNoHealth: a hand-over tells the next instance which health services a DRA
// driver's socket advertises: the next instance asks the endpoint nothing (kubelet and the
// driver see nothing), and its GetInfo answers what kubelet was told. A restart of the driver
// afterwards is asked again.
func TestHandOverAsksNoHealth(t *testing.T) {
	dir := testkit.ShortDir(t)
	reg := filepath.Join(dir, "reg")
	d := testDriver(dir, "gpu.example.com", config.DRAPlugin, filepath.Join(dir, "ep", "dra.sock"))
	calls := new(atomic.Int32)
	serve := func() *endpoint {
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
	if b.sup.Adopted() != 1 {
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
