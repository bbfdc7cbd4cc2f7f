package endpoints

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"
	drahealth "k8s.io/kubelet/pkg/apis/dra-health/v1alpha1"
	drapbv1 "k8s.io/kubelet/pkg/apis/dra/v1"
	drapbv1beta1 "k8s.io/kubelet/pkg/apis/dra/v1beta1"
)

// DRASupportedServices are the services a DRA endpoint serves, most preferred first, as a DRA
// registration lists them in PluginInfo.SupportedVersions.
var DRASupportedServices = []string{drapbv1.DRAPluginService, drapbv1beta1.DRAPluginService}

// DRAOptions describes the DRA kubelet plugin StartDRA serves.
type DRAOptions struct {
	// DriverName is the DRA driver's name. The kubelet takes it from the registration; the
	// endpoint names it in its errors. Required.
	DriverName string
	// Pool and Device, when set, name the device every claim is prepared with (the one device
	// of the test's ResourceSlice); kubelet records it for the claim, and a pod's
	// allocatedResourcesStatus reports its health. Empty: claims are prepared with no device.
	Pool, Device string
	// Health serves v1alpha1.DRAResourceHealth: NodeWatchResources sends Device's health at
	// once (Healthy) and again after every SetHealth. Without it the service is unimplemented.
	Health bool
	// V1HealthUnimplementedAfter, when positive, registers v1.DRAResourceHealth too, whose
	// NodeWatchResources answers Unimplemented only this late (a stream interceptor holds the
	// call), as a driver built on the generated Unimplemented server behind a slow interceptor
	// does: it still serves no v1 health. Zero: v1 is not registered, and the gRPC server
	// answers Unimplemented at once, before any interceptor or handler.
	V1HealthUnimplementedAfter time.Duration
}

// DRA is a DRA kubelet plugin endpoint serving the DRAPlugin service in versions v1 and
// v1beta1. When the kubelet registers a DRA driver it creates a gRPC connection to the endpoint
// and asks it to connect at once, and it treats the driver as usable while that connection is
// up; with the ResourceHealthStatus feature (beta, on by default in 1.36) it also calls
// v1alpha1.DRAResourceHealth/NodeWatchResources, every 5 s while that fails (1.37: only when the
// registration lists the service, and never again after Unimplemented). Unless DRAOptions.Health
// is set, this endpoint leaves the health service unimplemented: the kubelet logs the error and
// carries on.
type DRA struct {
	srv  *server
	opts DRAOptions

	mu      sync.Mutex
	conns   int
	calls   map[string]int // full method name → RPCs received
	healthy bool
	changed chan struct{} // closed and replaced by SetHealth
	quit    chan struct{} // closed by Stop: health streams return
	stopped sync.Once
}

// StartDRA serves a DRA kubelet plugin on the unix socket path until Stop.
func StartDRA(path string, opts DRAOptions) (*DRA, error) {
	if opts.DriverName == "" {
		return nil, errors.New("dra endpoint: driverName: must not be empty")
	}
	d := &DRA{opts: opts, calls: make(map[string]int), healthy: true, changed: make(chan struct{}), quit: make(chan struct{})}
	v1 := draServer{d: d}
	srvOpts := []grpc.ServerOption{grpc.StatsHandler(draStats{d: d})}
	if after := opts.V1HealthUnimplementedAfter; after > 0 {
		srvOpts = append(srvOpts, grpc.StreamInterceptor(holdV1Health(after)))
	}
	srv, err := serve(path, func(s *grpc.Server) {
		drapbv1.RegisterDRAPluginServer(s, v1)
		drapbv1beta1.RegisterDRAPluginServer(s, drapbv1beta1.V1ServerWrapper{DRAPluginServer: v1})
		if opts.Health {
			drahealth.RegisterDRAResourceHealthServer(s, draHealth{d: d})
		}
		if opts.V1HealthUnimplementedAfter > 0 {
			s.RegisterService(&draHealthV1Unimplemented, nil)
		}
	}, srvOpts...)
	if err != nil {
		return nil, fmt.Errorf("dra endpoint %q: %w", opts.DriverName, err)
	}
	d.srv = srv
	return d, nil
}

// Path returns the socket path the endpoint serves on.
func (d *DRA) Path() string { return d.srv.path }

// Stop ends every health stream, stops serving and removes the socket if it is still the
// endpoint's own. It blocks until the server's goroutines have exited and is idempotent.
func (d *DRA) Stop() {
	d.stopped.Do(func() { close(d.quit) })
	d.srv.stop()
}

// SetHealth reports the device healthy or not on every open health stream.
func (d *DRA) SetHealth(healthy bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.healthy = healthy
	close(d.changed)
	d.changed = make(chan struct{})
}

// Connections reports how many client connections the endpoint has accepted since start.
func (d *DRA) Connections() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.conns
}

// Calls reports how many RPCs named method the endpoint has received since start, whatever their
// outcome, including RPCs of services it does not serve. method is either a full gRPC method name
// such as drapbv1.DRAPlugin_NodePrepareResources_FullMethodName, or a bare method name such as
// "NodePrepareResources", which counts the method in every service.
func (d *DRA) Calls(method string) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	if strings.Contains(method, "/") {
		return d.calls[method]
	}
	n := 0
	for full, c := range d.calls {
		if full[strings.LastIndex(full, "/")+1:] == method {
			n += c
		}
	}
	return n
}

// draServer serves DRAPlugin v1: every claim is prepared with no devices, and unprepared.
type draServer struct {
	drapbv1.UnimplementedDRAPluginServer
	d *DRA
}

func (s draServer) NodePrepareResources(_ context.Context, req *drapbv1.NodePrepareResourcesRequest) (*drapbv1.NodePrepareResourcesResponse, error) {
	resp := &drapbv1.NodePrepareResourcesResponse{Claims: make(map[string]*drapbv1.NodePrepareResourceResponse)}
	for _, claim := range req.GetClaims() {
		r := &drapbv1.NodePrepareResourceResponse{}
		if o := s.d.opts; o.Device != "" {
			r.Devices = []*drapbv1.Device{{PoolName: o.Pool, DeviceName: o.Device}}
		}
		resp.Claims[claim.GetUid()] = r
	}
	return resp, nil
}

func (draServer) NodeUnprepareResources(_ context.Context, req *drapbv1.NodeUnprepareResourcesRequest) (*drapbv1.NodeUnprepareResourcesResponse, error) {
	resp := &drapbv1.NodeUnprepareResourcesResponse{Claims: make(map[string]*drapbv1.NodeUnprepareResourceResponse)}
	for _, claim := range req.GetClaims() {
		resp.Claims[claim.GetUid()] = &drapbv1.NodeUnprepareResourceResponse{}
	}
	return resp, nil
}

// draStats counts connections and RPCs as the gRPC server sees them, so that connections without
// RPCs and RPCs to services the endpoint does not serve are counted too.
type draStats struct{ d *DRA }

func (h draStats) TagRPC(ctx context.Context, info *stats.RPCTagInfo) context.Context {
	h.d.mu.Lock()
	defer h.d.mu.Unlock()
	h.d.calls[info.FullMethodName]++
	return ctx
}

func (draStats) HandleRPC(context.Context, stats.RPCStats) {}

func (draStats) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }

func (h draStats) HandleConn(_ context.Context, s stats.ConnStats) {
	if _, ok := s.(*stats.ConnBegin); ok {
		h.d.mu.Lock()
		defer h.d.mu.Unlock()
		h.d.conns++
	}
}

// draHealth serves v1alpha1.DRAResourceHealth: the device's health, at once and on every change.
type draHealth struct {
	drahealth.UnimplementedDRAResourceHealthServer
	d *DRA
}

func (h draHealth) NodeWatchResources(_ *drahealth.NodeWatchResourcesRequest, stream grpc.ServerStreamingServer[drahealth.NodeWatchResourcesResponse]) error {
	d := h.d
	for {
		d.mu.Lock()
		healthy, changed := d.healthy, d.changed
		d.mu.Unlock()
		st := drahealth.HealthStatus_UNHEALTHY
		if healthy {
			st = drahealth.HealthStatus_HEALTHY
		}
		err := stream.Send(&drahealth.NodeWatchResourcesResponse{Devices: []*drahealth.DeviceHealth{{
			Device:          &drahealth.DeviceIdentifier{PoolName: d.opts.Pool, DeviceName: d.opts.Device},
			Health:          st,
			LastUpdatedTime: time.Now().Unix(),
		}}})
		if err != nil {
			return err
		}
		select {
		case <-changed:
		case <-stream.Context().Done():
			return nil
		case <-d.quit:
			return nil
		}
	}
}

// DRAHealthV1WatchMethod is v1.DRAResourceHealth's NodeWatchResources, as Calls names it.
const DRAHealthV1WatchMethod = "/v1.DRAResourceHealth/NodeWatchResources"

// draHealthV1Unimplemented is v1.DRAResourceHealth answering Unimplemented, as its generated
// Unimplemented server does. It is described here because the kubelet API module this module
// builds with has no v1 of the service.
var draHealthV1Unimplemented = grpc.ServiceDesc{
	ServiceName: "v1.DRAResourceHealth",
	HandlerType: (*any)(nil),
	Streams: []grpc.StreamDesc{{
		StreamName:    "NodeWatchResources",
		ServerStreams: true,
		Handler: func(any, grpc.ServerStream) error {
			return status.Error(codes.Unimplemented, "method NodeWatchResources not implemented")
		},
	}},
}

// holdV1Health holds every call of DRAHealthV1WatchMethod for after, or until the call ends,
// before its handler runs.
func holdV1Health(after time.Duration) grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		if info.FullMethod == DRAHealthV1WatchMethod {
			t := time.NewTimer(after)
			defer t.Stop()
			select {
			case <-t.C:
			case <-ss.Context().Done():
				return ss.Context().Err()
			}
		}
		return handler(srv, ss)
	}
}
