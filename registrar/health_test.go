package registrar

import (
	"context"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	drahealthv1 "k8s.io/kubelet/pkg/apis/dra-health/v1"
	drahealthv1alpha1 "k8s.io/kubelet/pkg/apis/dra-health/v1alpha1"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/testkit"
)

// healthV1 serves v1.DRAResourceHealth: with send, NodeWatchResources sends the devices' health
// at once, as the DRA kubeletplugin helper does; without, it says nothing until a change.
type healthV1 struct {
	drahealthv1.UnimplementedDRAResourceHealthServer
	send  bool
	calls *atomic.Int32 // counts the calls, if set
}

func (h healthV1) NodeWatchResources(_ *drahealthv1.NodeWatchResourcesRequest, s grpc.ServerStreamingServer[drahealthv1.NodeWatchResourcesResponse]) error {
	if h.calls != nil {
		h.calls.Add(1)
	}
	if h.send {
		if err := s.Send(&drahealthv1.NodeWatchResourcesResponse{}); err != nil {
			return err
		}
	}
	<-s.Context().Done()
	return nil
}

// healthV1alpha1 serves v1alpha1.DRAResourceHealth, sending at once.
type healthV1alpha1 struct {
	drahealthv1alpha1.UnimplementedDRAResourceHealthServer
}

func (healthV1alpha1) NodeWatchResources(_ *drahealthv1alpha1.NodeWatchResourcesRequest, s grpc.ServerStreamingServer[drahealthv1alpha1.NodeWatchResourcesResponse]) error {
	if err := s.Send(&drahealthv1alpha1.NodeWatchResourcesResponse{}); err != nil {
		return err
	}
	<-s.Context().Done()
	return nil
}

// healthEndpoint serves a DRA driver's endpoint at path with the health services named.
func healthEndpoint(t testing.TB, path string, services ...string) *endpoint {
	t.Helper()
	return serveEndpoint(t, path, func(srv *grpc.Server) {
		for _, svc := range services {
			switch svc {
			case "v1":
				drahealthv1.RegisterDRAResourceHealthServer(srv, healthV1{send: true})
			case "v1-quiet":
				drahealthv1.RegisterDRAResourceHealthServer(srv, healthV1{})
			case "v1alpha1":
				drahealthv1alpha1.RegisterDRAResourceHealthServer(srv, healthV1alpha1{})
			default:
				t.Fatalf("unknown health service %q", svc)
			}
		}
	})
}

// TestHealthServiceNames: the names multireg advertises are kubelet's own, and each can be
// asked.
func TestHealthServiceNames(t *testing.T) {
	want := []string{drahealthv1.DRAResourceHealthService, drahealthv1alpha1.DRAResourceHealthService}
	if !slices.Equal(config.HealthServices, want) {
		t.Errorf("config.HealthServices = %q, want kubelet's %q, newest first", config.HealthServices, want)
	}
	for _, svc := range config.HealthServices {
		if healthWatches[svc] == nil {
			t.Errorf("no NodeWatchResources call for %s", svc)
		}
	}
}

// TestHealthServicesDetected: the services a DRA endpoint serves are told apart from those it
// does not, whether its stream sends at once or stays quiet.
func TestHealthServicesDetected(t *testing.T) {
	for _, tt := range []struct {
		serves []string
		want   []string
	}{
		{nil, nil},
		{[]string{"v1alpha1"}, []string{"v1alpha1.DRAResourceHealth"}},
		{[]string{"v1"}, []string{"v1.DRAResourceHealth"}},
		{[]string{"v1-quiet"}, []string{"v1.DRAResourceHealth"}},
		{[]string{"v1", "v1alpha1"}, []string{"v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"}},
	} {
		t.Run(strings.Join(append([]string{"serves"}, tt.serves...), "-"), func(t *testing.T) {
			path := filepath.Join(testkit.ShortDir(t), "dra.sock")
			healthEndpoint(t, path, tt.serves...)
			got, err := healthServices(context.Background(), path)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("healthServices = %q, want %q", got, tt.want)
			}
		})
	}
}

// TestHealthServicesNoAnswer: an endpoint that accepts connections and never speaks gRPC is
// not ready, rather than taken to serve health.
func TestHealthServicesNoAnswer(t *testing.T) {
	path := filepath.Join(testkit.ShortDir(t), "dra.sock")
	l, err := listenUnlinked(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	// The kernel completes the connections; nothing ever answers on them.
	got, err := healthServices(context.Background(), path)
	if err == nil {
		t.Fatalf("healthServices on a silent endpoint = %q, want an error", got)
	}
}

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
			healthEndpoint(t, d.LocalEndpoint, tt.serves...)
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
	e := healthEndpoint(t, d.LocalEndpoint)
	s := runSupervisor(t, Options{Log: log.Logger()})
	s.Start(d)
	awaitSocket(t, d)
	registerAndWait(t, s, d)
	first := mustID(t, d.SocketPath)

	// The same services after a restart: the registration stays.
	crash(t, s, d, e)
	e = healthEndpoint(t, d.LocalEndpoint)
	const kept = "driver endpoint restarted; kubelet reconnects to it by itself, the registration stays"
	testkit.Eventually(t, 5*time.Second, "the restart kept", func() bool { return strings.Contains(log.String(), kept) })
	if id := mustID(t, d.SocketPath); id != first {
		t.Fatal("the registration socket replaced after a restart with the same health services")
	}

	// An upgrade that serves health: registered again, advertising it.
	crash(t, s, d, e)
	healthEndpoint(t, d.LocalEndpoint, "v1")
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
			drahealthv1.RegisterDRAResourceHealthServer(srv, healthV1{send: true, calls: calls})
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
