package endpoints

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	drahealth "k8s.io/kubelet/pkg/apis/dra-health/v1alpha1"
	drapbv1 "k8s.io/kubelet/pkg/apis/dra/v1"
	drapbv1beta1 "k8s.io/kubelet/pkg/apis/dra/v1beta1"
	"multireg.dev/multireg/e2e/internal/wait"
)

// waitFor polls cond until it holds, failing the test after a deadline.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	wait.Every(t, 5*time.Millisecond, 10*time.Second, what, cond)
}

// checkGoroutines fails the test if, after every later cleanup (Stop, conn.Close) has run, more
// goroutines are left than when it was called. Call it first in a test.
func checkGoroutines(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Cleanup(func() {
		waitFor(t, "goroutines to exit", func() bool { return runtime.NumGoroutine() <= before })
	})
}

// socketPath returns name in a new short temporary directory: unix socket paths are limited to
// 107 bytes.
func socketPath(t *testing.T, name string) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "ep")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return filepath.Join(dir, name)
}

func dial(t *testing.T, path string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient("unix:"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func wantCode(t *testing.T, what string, err error, want codes.Code) {
	t.Helper()
	if got := status.Code(err); got != want {
		t.Fatalf("%s: got code %v (%v), want %v", what, got, err, want)
	}
}

func TestCSI(t *testing.T) {
	checkGoroutines(t)
	path := socketPath(t, "csi.sock")
	ep, err := StartCSI(path, CSIOptions{
		Name:            "csi.example.com",
		NodeID:          "node-1",
		MaxVolumes:      7,
		Topology:        map[string]string{"topology.example.com/zone": "z1"},
		FailNodeGetInfo: 2,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ep.Stop)
	if ep.Path() != path {
		t.Errorf("Path() = %q, want %q", ep.Path(), path)
	}
	ctx := ctxT(t)
	conn := dial(t, path)
	identity, node := csi.NewIdentityClient(conn), csi.NewNodeClient(conn)

	info, err := identity.GetPluginInfo(ctx, &csi.GetPluginInfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if info.GetName() != "csi.example.com" || info.GetVendorVersion() != CSIVendorVersion {
		t.Errorf("GetPluginInfo = %v", info)
	}
	caps, err := identity.GetPluginCapabilities(ctx, &csi.GetPluginCapabilitiesRequest{})
	if err != nil || len(caps.GetCapabilities()) != 0 {
		t.Errorf("GetPluginCapabilities = %v, %v; want none", caps, err)
	}
	probe, err := identity.Probe(ctx, &csi.ProbeRequest{})
	if err != nil || !probe.GetReady().GetValue() {
		t.Errorf("Probe = %v, %v; want ready", probe, err)
	}

	if !ep.LastNodeGetInfo().IsZero() {
		t.Errorf("LastNodeGetInfo before any call = %v", ep.LastNodeGetInfo())
	}
	for i := range 2 {
		_, err := node.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
		wantCode(t, "injected NodeGetInfo failure", err, codes.Unavailable)
		if !strings.Contains(err.Error(), "injected") {
			t.Errorf("failure %d: %v does not say it is injected", i, err)
		}
	}
	start := time.Now()
	got, err := node.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if got.GetNodeId() != "node-1" || got.GetMaxVolumesPerNode() != 7 ||
		got.GetAccessibleTopology().GetSegments()["topology.example.com/zone"] != "z1" {
		t.Errorf("NodeGetInfo = %v", got)
	}
	if ok, failed := ep.NodeGetInfoCalls(); ok != 1 || failed != 2 {
		t.Errorf("NodeGetInfoCalls = %d ok, %d failed; want 1, 2", ok, failed)
	}
	if last := ep.LastNodeGetInfo(); last.Before(start) {
		t.Errorf("LastNodeGetInfo = %v, before the last call at %v", last, start)
	}

	ep.SetFailNodeGetInfo(1)
	_, err = node.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	wantCode(t, "NodeGetInfo after SetFailNodeGetInfo(1)", err, codes.Unavailable)
	if _, err := node.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{}); err != nil {
		t.Fatal(err)
	}
	if ok, failed := ep.NodeGetInfoCalls(); ok != 2 || failed != 3 {
		t.Errorf("NodeGetInfoCalls = %d ok, %d failed; want 2, 3", ok, failed)
	}
	if at := ep.NodeGetInfoFailures(); len(at) != 3 || at[2].Before(at[1]) || at[2].Before(start) {
		t.Errorf("NodeGetInfoFailures = %v; want the 3 failed calls in order, the last after %v", at, start)
	}

	nodeCaps, err := node.NodeGetCapabilities(ctx, &csi.NodeGetCapabilitiesRequest{})
	if err != nil || len(nodeCaps.GetCapabilities()) != 0 {
		t.Errorf("NodeGetCapabilities = %v, %v; want none", nodeCaps, err)
	}
	_, err = node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{})
	wantCode(t, "NodeStageVolume", err, codes.Unimplemented)

	ep.Stop()
	if _, err := os.Lstat(path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket after Stop: %v, want it removed", err)
	}
}

func deviceIDs(resp *pluginapi.ListAndWatchResponse) []string {
	var ids []string
	for _, d := range resp.GetDevices() {
		if d.GetHealth() != pluginapi.Healthy {
			return append(ids, d.GetID()+" is "+d.GetHealth())
		}
		ids = append(ids, d.GetID())
	}
	return ids
}

func TestDevicePlugin(t *testing.T) {
	checkGoroutines(t)
	path := socketPath(t, "widget.sock")
	ep, err := StartDevicePlugin(path, DeviceOptions{ResourceName: "example.com/widget", Devices: 3})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ep.Stop)
	ctx := ctxT(t)
	client := pluginapi.NewDevicePluginClient(dial(t, path))

	// The kubelet's order: options, then one long ListAndWatch.
	opts, err := client.GetDevicePluginOptions(ctx, &pluginapi.Empty{})
	if err != nil {
		t.Fatal(err)
	}
	if opts.GetPreStartRequired() || opts.GetGetPreferredAllocationAvailable() {
		t.Errorf("GetDevicePluginOptions = %v, want empty", opts)
	}
	stream, err := client.ListAndWatch(ctx, &pluginapi.Empty{})
	if err != nil {
		t.Fatal(err)
	}
	resp, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if got, want := deviceIDs(resp), []string{"dev-0", "dev-1", "dev-2"}; !slices.Equal(got, want) {
		t.Errorf("first ListAndWatch = %v, want %v", got, want)
	}
	if opened, open := ep.ListAndWatchStreams(); opened != 1 || open != 1 {
		t.Errorf("ListAndWatchStreams = %d opened, %d open; want 1, 1", opened, open)
	}

	ep.SetDevices(1)
	if resp, err = stream.Recv(); err != nil {
		t.Fatal(err)
	}
	if got, want := deviceIDs(resp), []string{"dev-0"}; !slices.Equal(got, want) {
		t.Errorf("ListAndWatch after SetDevices(1) = %v, want %v", got, want)
	}

	// A second stream, closed by its client.
	ctx2, cancel2 := context.WithCancel(ctx)
	stream2, err := client.ListAndWatch(ctx2, &pluginapi.Empty{})
	if err != nil {
		t.Fatal(err)
	}
	if resp, err = stream2.Recv(); err != nil || len(resp.GetDevices()) != 1 {
		t.Fatalf("second stream's first list = %v, %v; want 1 device", resp, err)
	}
	if opened, open := ep.ListAndWatchStreams(); opened != 2 || open != 2 {
		t.Errorf("ListAndWatchStreams = %d opened, %d open; want 2, 2", opened, open)
	}
	cancel2()
	waitFor(t, "the cancelled stream to close", func() bool {
		opened, open := ep.ListAndWatchStreams()
		return opened == 2 && open == 1
	})

	alloc, err := client.Allocate(ctx, &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{
		{DevicesIds: []string{"dev-0"}}, {DevicesIds: []string{"dev-0"}},
	}})
	if err != nil || len(alloc.GetContainerResponses()) != 2 {
		t.Errorf("Allocate = %v, %v; want 2 container responses", alloc, err)
	}
	pref, err := client.GetPreferredAllocation(ctx, &pluginapi.PreferredAllocationRequest{
		ContainerRequests: []*pluginapi.ContainerPreferredAllocationRequest{{AvailableDeviceIDs: []string{"dev-0"}, AllocationSize: 1}},
	})
	if err != nil || len(pref.GetContainerResponses()) != 1 {
		t.Errorf("GetPreferredAllocation = %v, %v; want 1 container response", pref, err)
	}
	if _, err := client.PreStartContainer(ctx, &pluginapi.PreStartContainerRequest{DevicesIds: []string{"dev-0"}}); err != nil {
		t.Errorf("PreStartContainer: %v", err)
	}

	// Stop ends the open stream, as a plugin going away does for the kubelet.
	ep.Stop()
	if _, err := stream.Recv(); err == nil {
		t.Error("ListAndWatch stream still delivers after Stop")
	}
	if opened, open := ep.ListAndWatchStreams(); opened != 2 || open != 0 {
		t.Errorf("ListAndWatchStreams after Stop = %d opened, %d open; want 2, 0", opened, open)
	}
	if _, err := os.Lstat(path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket after Stop: %v, want it removed", err)
	}
}

func TestDRA(t *testing.T) {
	checkGoroutines(t)
	path := socketPath(t, "dra.sock")
	ep, err := StartDRA(path, DRAOptions{DriverName: "dra.example.com"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ep.Stop)
	ctx := ctxT(t)
	if n := ep.Connections(); n != 0 {
		t.Errorf("Connections before any client = %d", n)
	}

	// The kubelet's registration: a client connection, connected at once, no RPC.
	conn := dial(t, path)
	conn.Connect()
	waitFor(t, "the connection to be seen", func() bool { return ep.Connections() == 1 })

	claims := []*drapbv1.Claim{{Namespace: "ns", Uid: "uid-1", Name: "c1"}, {Namespace: "ns", Uid: "uid-2", Name: "c2"}}
	prep, err := drapbv1.NewDRAPluginClient(conn).NodePrepareResources(ctx, &drapbv1.NodePrepareResourcesRequest{Claims: claims})
	if err != nil {
		t.Fatal(err)
	}
	for _, uid := range []string{"uid-1", "uid-2"} {
		if r, ok := prep.GetClaims()[uid]; !ok || r.GetError() != "" {
			t.Errorf("v1 NodePrepareResources result for %s = %v, %v; want an empty result", uid, r, ok)
		}
	}
	unprep, err := drapbv1.NewDRAPluginClient(conn).NodeUnprepareResources(ctx, &drapbv1.NodeUnprepareResourcesRequest{Claims: claims})
	if err != nil || len(unprep.GetClaims()) != 2 {
		t.Errorf("v1 NodeUnprepareResources = %v, %v; want 2 results", unprep, err)
	}
	beta, err := drapbv1beta1.NewDRAPluginClient(conn).NodePrepareResources(ctx, &drapbv1beta1.NodePrepareResourcesRequest{
		Claims: []*drapbv1beta1.Claim{{Namespace: "ns", Uid: "uid-3", Name: "c3"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := beta.GetClaims()["uid-3"]; !ok {
		t.Errorf("v1beta1 NodePrepareResources = %v, want a result for uid-3", beta)
	}

	// The health service stays unimplemented, and the attempt is counted.
	health, err := drahealth.NewDRAResourceHealthClient(conn).NodeWatchResources(ctx, &drahealth.NodeWatchResourcesRequest{})
	if err == nil {
		_, err = health.Recv()
	}
	wantCode(t, "NodeWatchResources", err, codes.Unimplemented)

	for _, c := range []struct {
		method string
		want   int
	}{
		{"NodePrepareResources", 2},
		{drapbv1.DRAPlugin_NodePrepareResources_FullMethodName, 1},
		{drapbv1beta1.DRAPlugin_NodePrepareResources_FullMethodName, 1},
		{"NodeUnprepareResources", 1},
		{"NodeWatchResources", 1},
		{"Nothing", 0},
	} {
		if got := ep.Calls(c.method); got != c.want {
			t.Errorf("Calls(%q) = %d, want %d", c.method, got, c.want)
		}
	}
	if n := ep.Connections(); n != 1 {
		t.Errorf("Connections = %d, want the one connection reused", n)
	}
	if got, want := DRASupportedServices, []string{"v1.DRAPlugin", "v1beta1.DRAPlugin"}; !slices.Equal(got, want) {
		t.Errorf("DRASupportedServices = %v, want %v", got, want)
	}
}

// TestDRAV1HealthUnimplementedLate: with V1HealthUnimplementedAfter, a DRA endpoint serving
// v1alpha1 health answers v1.DRAResourceHealth's NodeWatchResources Unimplemented, no sooner
// than the delay asked for; v1alpha1's stream reports the device as before. Without it, v1 is
// not registered at all.
func TestDRAV1HealthUnimplementedLate(t *testing.T) {
	checkGoroutines(t)
	const after = 500 * time.Millisecond
	path := socketPath(t, "dra.sock")
	ep, err := StartDRA(path, DRAOptions{DriverName: "dra.example.com", Pool: "pool", Device: "dev-0", Health: true, V1HealthUnimplementedAfter: after})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ep.Stop)
	conn := dial(t, path)
	ctx := ctxT(t)

	alpha, err := drahealth.NewDRAResourceHealthClient(conn).NodeWatchResources(ctx, &drahealth.NodeWatchResourcesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	report, err := alpha.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if devs := report.GetDevices(); len(devs) != 1 || devs[0].GetDevice().GetDeviceName() != "dev-0" || devs[0].GetHealth() != drahealth.HealthStatus_HEALTHY {
		t.Errorf("v1alpha1 report = %v, want dev-0 Healthy", report)
	}

	watchV1 := func(conn *grpc.ClientConn) error {
		stream, err := conn.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true}, DRAHealthV1WatchMethod)
		if err != nil {
			return err
		}
		if err := stream.SendMsg(&drahealth.NodeWatchResourcesRequest{}); err != nil {
			return err
		}
		if err := stream.CloseSend(); err != nil {
			return err
		}
		return stream.RecvMsg(&drahealth.NodeWatchResourcesResponse{})
	}
	start := time.Now()
	err = watchV1(conn)
	took := time.Since(start)
	wantCode(t, "v1 NodeWatchResources", err, codes.Unimplemented)
	if took < after {
		t.Errorf("v1 NodeWatchResources answered Unimplemented after %s, want no sooner than %s", took, after)
	}
	if n := ep.Calls(DRAHealthV1WatchMethod); n != 1 {
		t.Errorf("Calls(%q) = %d, want 1", DRAHealthV1WatchMethod, n)
	}

	plain, err := StartDRA(socketPath(t, "dra.sock"), DRAOptions{DriverName: "plain.example.com", Health: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(plain.Stop)
	err = watchV1(dial(t, plain.Path()))
	wantCode(t, "v1 NodeWatchResources without the option", err, codes.Unimplemented)
	if !strings.Contains(status.Convert(err).Message(), "unknown service") {
		t.Errorf("v1 NodeWatchResources without the option: %v, want the server's unknown service", err)
	}
}

// staleSocket leaves a socket file at path that nobody listens on.
func staleSocket(t *testing.T, path string) {
	t.Helper()
	lis, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	lis.SetUnlinkOnClose(false)
	lis.Close()
}

func TestStaleSocketIsReplaced(t *testing.T) {
	checkGoroutines(t)
	path := socketPath(t, "csi.sock")
	staleSocket(t, path)
	ep, err := StartCSI(path, CSIOptions{Name: "csi.example.com", NodeID: "n"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ep.Stop)
	if _, err := csi.NewIdentityClient(dial(t, path)).Probe(ctxT(t), &csi.ProbeRequest{}); err != nil {
		t.Fatalf("Probe on the replaced socket: %v", err)
	}
	fi, err := os.Lstat(path)
	if err != nil {
		t.Fatal(err)
	}
	if perm := fi.Mode().Perm(); perm != 0o660 {
		t.Errorf("socket mode = %v, want 0660", perm)
	}
}

// TestStopKeepsSuccessorSocket: an endpoint whose socket was replaced by another endpoint's does
// not remove the newcomer's socket when it stops.
func TestStopKeepsSuccessorSocket(t *testing.T) {
	checkGoroutines(t)
	path := socketPath(t, "dra.sock")
	old, err := StartDRA(path, DRAOptions{DriverName: "old.example.com"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(old.Stop)
	successor, err := StartDRA(path, DRAOptions{DriverName: "new.example.com"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(successor.Stop)

	old.Stop()
	if _, err := os.Lstat(path); err != nil {
		t.Fatalf("successor's socket after the old endpoint stopped: %v", err)
	}
	conn := dial(t, path)
	conn.Connect()
	waitFor(t, "the successor to see a connection", func() bool { return successor.Connections() == 1 })
	if n := old.Connections(); n != 0 {
		t.Errorf("old endpoint saw %d connections, want 0", n)
	}
	successor.Stop()
	if _, err := os.Lstat(path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket after the successor stopped: %v, want it removed", err)
	}
}

func TestRefuseNonSocket(t *testing.T) {
	checkGoroutines(t)
	for _, c := range []struct {
		name  string
		start func(path string) error
	}{
		{"csi", func(path string) error {
			_, err := StartCSI(path, CSIOptions{Name: "csi.example.com", NodeID: "n"})
			return err
		}},
		{"device plugin", func(path string) error {
			_, err := StartDevicePlugin(path, DeviceOptions{ResourceName: "example.com/widget"})
			return err
		}},
		{"dra", func(path string) error {
			_, err := StartDRA(path, DRAOptions{DriverName: "dra.example.com"})
			return err
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			path := socketPath(t, "plugin.sock")
			if err := os.WriteFile(path, []byte("keep me"), 0o600); err != nil {
				t.Fatal(err)
			}
			err := c.start(path)
			if err == nil || !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), "not a socket") {
				t.Fatalf("start over a regular file: %v, want an error naming %s as not a socket", err, path)
			}
			if b, err := os.ReadFile(path); err != nil || string(b) != "keep me" {
				t.Errorf("regular file after refused start: %q, %v; want it untouched", b, err)
			}
		})
	}
}

func TestCreatesParentDirectory(t *testing.T) {
	checkGoroutines(t)
	path := filepath.Join(filepath.Dir(socketPath(t, "x")), "a", "b", "widget.sock")
	ep, err := StartDevicePlugin(path, DeviceOptions{ResourceName: "example.com/widget", Devices: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ep.Stop)
	if _, err := pluginapi.NewDevicePluginClient(dial(t, path)).GetDevicePluginOptions(ctxT(t), &pluginapi.Empty{}); err != nil {
		t.Fatal(err)
	}
}

func TestInvalidOptions(t *testing.T) {
	for _, c := range []struct {
		name    string
		start   func(path string) error
		wantErr string
	}{
		{"csi without name", func(path string) error {
			_, err := StartCSI(path, CSIOptions{NodeID: "n"})
			return err
		}, "name: must not be empty"},
		{"csi without node ID", func(path string) error {
			_, err := StartCSI(path, CSIOptions{Name: "csi.example.com"})
			return err
		}, "nodeID: must not be empty"},
		{"device plugin without domain", func(path string) error {
			_, err := StartDevicePlugin(path, DeviceOptions{ResourceName: "widget"})
			return err
		}, `resourceName: "widget"`},
		{"device plugin with negative devices", func(path string) error {
			_, err := StartDevicePlugin(path, DeviceOptions{ResourceName: "example.com/widget", Devices: -1})
			return err
		}, "devices: -1"},
		{"dra without driver name", func(path string) error {
			_, err := StartDRA(path, DRAOptions{})
			return err
		}, "driverName: must not be empty"},
	} {
		t.Run(c.name, func(t *testing.T) {
			path := socketPath(t, "plugin.sock")
			err := c.start(path)
			if err == nil || !strings.Contains(err.Error(), c.wantErr) {
				t.Fatalf("got %v, want an error containing %q", err, c.wantErr)
			}
			if _, err := os.Lstat(path); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("invalid options left %s behind: %v", path, err)
			}
		})
	}
}

// TestStopWithOpenStream: Stop returns even while a client holds a stream open and never closes
// its connection, as the kubelet does with ListAndWatch.
func TestStopWithOpenStream(t *testing.T) {
	checkGoroutines(t)
	path := socketPath(t, "widget.sock")
	ep, err := StartDevicePlugin(path, DeviceOptions{ResourceName: "example.com/widget", Devices: 2})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ep.Stop)
	stream, err := pluginapi.NewDevicePluginClient(dial(t, path)).ListAndWatch(ctxT(t), &pluginapi.Empty{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		ep.Stop()
	}()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Stop did not return with a stream open")
	}
	if _, err := stream.Recv(); !errors.Is(err, io.EOF) {
		t.Errorf("stream after Stop: %v, want io.EOF", err)
	}
}
