package health

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthgrpc "google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/probe"
	"multireg.dev/multireg/internal/testkit"
)

// identity is a CSI driver's Identity whose Probe answers ready (nil: unset), after wait.
type identity struct {
	testkit.Identity
	ready *bool
	wait  chan struct{} // nil: answer at once
	calls atomic.Int32
}

func (i *identity) Probe(ctx context.Context, _ *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	i.calls.Add(1)
	if i.wait != nil {
		select {
		case <-i.wait:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	r := &csi.ProbeResponse{}
	if i.ready != nil {
		r.Ready = wrapperspb.Bool(*i.ready)
	}
	return r, nil
}

type devicePlugin struct {
	pluginapi.UnimplementedDevicePluginServer
}

func (devicePlugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

// drivers is a checker's drivers, by name.
type drivers map[string]Target

func (d drivers) get(name string) (Target, bool) {
	t, ok := d[name]
	return t, ok
}

func yes() *bool { b := true; return &b }
func no() *bool  { b := false; return &b }

// TestCheckEachType: each type's call and what its answer means — a CSI driver's Probe (ready
// unset or true: alive; false: not ready), a DRA driver's gRPC health (SERVING or
// Unimplemented: alive; NOT_SERVING: not), a device plugin's GetDevicePluginOptions; a driver
// whose socket is gone is not alive, and a name not in the file is unknown.
func TestCheckEachType(t *testing.T) {
	dir := testkit.ShortDir(t)
	ep := func(name string, register func(*grpc.Server)) string {
		p := filepath.Join(dir, name+".sock")
		testkit.ServeEndpoint(t, p, register)
		return p
	}
	notServing := healthgrpc.NewServer()
	notServing.SetServingStatus("", healthpb.HealthCheckResponse_NOT_SERVING)
	ds := drivers{
		"unset":      {Type: config.CSIPlugin, Path: ep("unset", func(s *grpc.Server) { csi.RegisterIdentityServer(s, &identity{}) })},
		"ready":      {Type: config.CSIPlugin, Path: ep("ready", func(s *grpc.Server) { csi.RegisterIdentityServer(s, &identity{ready: yes()}) })},
		"not-ready":  {Type: config.CSIPlugin, Path: ep("not-ready", func(s *grpc.Server) { csi.RegisterIdentityServer(s, &identity{ready: no()}) })},
		"dra":        {Type: config.DRAPlugin, Path: ep("dra", func(s *grpc.Server) { healthpb.RegisterHealthServer(s, healthgrpc.NewServer()) })},
		"dra-no-svc": {Type: config.DRAPlugin, Path: ep("dra-no-svc", func(*grpc.Server) {})},
		"dra-unwell": {Type: config.DRAPlugin, Path: ep("dra-unwell", func(s *grpc.Server) { healthpb.RegisterHealthServer(s, notServing) })},
		"device":     {Type: config.DevicePlugin, Path: ep("device", func(s *grpc.Server) { pluginapi.RegisterDevicePluginServer(s, devicePlugin{}) })},
		"gone":       {Type: config.CSIPlugin, Path: filepath.Join(dir, "gone.sock")},
		"csi-no-svc": {Type: config.CSIPlugin, Path: ep("csi-no-svc", func(*grpc.Server) {})},
		"dev-no-svc": {Type: config.DevicePlugin, Path: ep("dev-no-svc", func(*grpc.Server) {})},
	}
	for name, tgt := range ds {
		tgt.Name, tgt.Timeout = name, 2*time.Second
		ds[name] = tgt
	}
	c := New(ds.get, testkit.Logger(t))
	defer c.Close()
	for name, want := range map[string]string{
		"unset": "", "ready": "", "dra": "", "dra-no-svc": "", "device": "",
		"not-ready": "not ready", "dra-unwell": "NOT_SERVING", "gone": "no such file",
		"csi-no-svc": "Unimplemented", "dev-no-svc": "Unimplemented",
	} {
		res, err := c.Check(t.Context(), name)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		switch {
		case want == "" && res.Err != nil:
			t.Errorf("%s: %v, want alive", name, res.Err)
		case want != "" && (res.Err == nil || !strings.Contains(res.Err.Error(), want)):
			t.Errorf("%s: %v, want an error with %q", name, res.Err, want)
		}
		if want == "not ready" && !errors.Is(res.Err, probe.ErrNotReady) {
			t.Errorf("%s: %v, want ErrNotReady", name, res.Err)
		}
	}
	if _, err := c.Check(t.Context(), "nobody"); !errors.Is(err, ErrUnknown) {
		t.Errorf("an unknown driver: %v, want ErrUnknown", err)
	}
}

// TestHungDriverHoldsOnlyItself: a driver that never answers holds its own checks for its
// timeout, and no other driver's; its checks end with an error.
func TestHungDriverHoldsOnlyItself(t *testing.T) {
	dir := testkit.ShortDir(t)
	hung := &identity{wait: make(chan struct{})}
	defer close(hung.wait)
	hp, fp := filepath.Join(dir, "hung.sock"), filepath.Join(dir, "fine.sock")
	testkit.ServeEndpoint(t, hp, func(s *grpc.Server) { csi.RegisterIdentityServer(s, hung) })
	testkit.ServeEndpoint(t, fp, func(s *grpc.Server) { csi.RegisterIdentityServer(s, &identity{}) })
	ds := drivers{
		"hung": {Name: "hung", Type: config.CSIPlugin, Path: hp, Timeout: 500 * time.Millisecond},
		"fine": {Name: "fine", Type: config.CSIPlugin, Path: fp, Timeout: 2 * time.Second},
	}
	c := New(ds.get, testkit.Logger(t))
	defer c.Close()
	done := make(chan Result)
	go func() {
		res, _ := c.Check(context.Background(), "hung")
		done <- res
	}()
	testkit.Eventually(t, 5*time.Second, "the hung driver asked", func() bool { return hung.calls.Load() == 1 })
	if res, err := c.Check(t.Context(), "fine"); err != nil || res.Err != nil {
		t.Errorf("the other driver, while one hangs: %v %v", err, res.Err)
	}
	res := <-done
	if status.Code(res.Err) != codes.DeadlineExceeded || res.Took < 500*time.Millisecond {
		t.Errorf("the hung driver: %v after %s, want DeadlineExceeded after its 500ms", res.Err, res.Took)
	}
}

// TestConcurrentChecksShareOne: 100 checks of one slow driver at once make one call, on one
// connection, and all get its answer.
func TestConcurrentChecksShareOne(t *testing.T) {
	dir := testkit.ShortDir(t)
	slow := &identity{wait: make(chan struct{})}
	p := filepath.Join(dir, "slow.sock")
	var conns atomic.Int32
	testkit.ServeEndpointWith(t, p, func(s *grpc.Server) { csi.RegisterIdentityServer(s, slow) },
		grpc.StatsHandler(&connCounter{n: &conns}))
	ds := drivers{"slow": {Name: "slow", Type: config.CSIPlugin, Path: p, Timeout: 5 * time.Second}}
	c := New(ds.get, testkit.Logger(t))
	defer c.Close()
	var wg sync.WaitGroup
	var ok atomic.Int32
	for range 100 {
		wg.Go(func() {
			if res, err := c.Check(context.Background(), "slow"); err == nil && res.Err == nil {
				ok.Add(1)
			}
		})
	}
	testkit.Eventually(t, 5*time.Second, "the driver asked", func() bool { return slow.calls.Load() >= 1 })
	close(slow.wait)
	wg.Wait()
	if ok.Load() != 100 || slow.calls.Load() != 1 || conns.Load() != 1 {
		t.Errorf("%d of 100 checks alive, %d calls on %d connections; want 100 on 1 call and 1 connection", ok.Load(), slow.calls.Load(), conns.Load())
	}
}

// TestHTTPAndGRPC: GET /healthz/<driver> answers 200, 500 with the driver's words, or 404; the
// gRPC health service answers SERVING, NOT_SERVING or NOT_FOUND, and SERVING for multireg
// itself (service "").
func TestHTTPAndGRPC(t *testing.T) {
	dir := testkit.ShortDir(t)
	gp, bp := filepath.Join(dir, "g.sock"), filepath.Join(dir, "b.sock")
	testkit.ServeEndpoint(t, gp, func(s *grpc.Server) { csi.RegisterIdentityServer(s, &identity{}) })
	testkit.ServeEndpoint(t, bp, func(s *grpc.Server) { csi.RegisterIdentityServer(s, &identity{ready: no()}) })
	ds := drivers{
		"good.csi.example.com": {Name: "good.csi.example.com", Type: config.CSIPlugin, Path: gp, Timeout: 2 * time.Second},
		"example.com/bad":      {Name: "example.com/bad", Type: config.CSIPlugin, Path: bp, Timeout: 2 * time.Second},
	}
	c := New(ds.get, testkit.Logger(t))
	defer c.Close()
	srv := httptest.NewServer(http.StripPrefix("", c.Handler()))
	defer srv.Close()
	for path, want := range map[string]int{
		"/healthz/good.csi.example.com": 200, "/healthz/example.com/bad": 500, "/healthz/nobody": 404, "/healthz/": 404,
	} {
		resp, err := http.Get(srv.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Errorf("GET %s: %d %q, want %d", path, resp.StatusCode, body, want)
		}
		if want == 500 && !strings.Contains(string(body), "not ready") {
			t.Errorf("GET %s: %q, want the driver's words", path, body)
		}
	}

	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	healthpb.RegisterHealthServer(gs, c.GRPC())
	go gs.Serve(l)
	defer gs.Stop()
	conn, err := grpc.NewClient(l.Addr().String(), grpc.WithTransportCredentials(insecureCreds()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	hc := healthpb.NewHealthClient(conn)
	for service, want := range map[string]healthpb.HealthCheckResponse_ServingStatus{
		"": healthpb.HealthCheckResponse_SERVING, "good.csi.example.com": healthpb.HealthCheckResponse_SERVING,
		"example.com/bad": healthpb.HealthCheckResponse_NOT_SERVING,
	} {
		resp, err := hc.Check(t.Context(), &healthpb.HealthCheckRequest{Service: service})
		if err != nil || resp.GetStatus() != want {
			t.Errorf("gRPC Check %q: %v %v, want %v", service, resp.GetStatus(), err, want)
		}
	}
	if _, err := hc.Check(t.Context(), &healthpb.HealthCheckRequest{Service: "nobody"}); status.Code(err) != codes.NotFound {
		t.Errorf("gRPC Check of an unknown driver: %v, want NotFound", err)
	}
}

// connCounter counts the connections a gRPC server accepts.
type connCounter struct{ n *atomic.Int32 }

func (c *connCounter) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context { return ctx }
func (c *connCounter) HandleRPC(context.Context, stats.RPCStats)                       {}
func (c *connCounter) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context {
	return ctx
}
func (c *connCounter) HandleConn(_ context.Context, s stats.ConnStats) {
	if _, ok := s.(*stats.ConnBegin); ok {
		c.n.Add(1)
	}
}

func insecureCreds() credentials.TransportCredentials { return insecure.NewCredentials() }
