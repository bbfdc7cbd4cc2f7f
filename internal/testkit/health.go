package testkit

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	drahealthv1 "k8s.io/kubelet/pkg/apis/dra-health/v1"
	drahealthv1alpha1 "k8s.io/kubelet/pkg/apis/dra-health/v1alpha1"
)

// HealthV1 serves v1.DRAResourceHealth: with Send, NodeWatchResources sends the devices' health
// at once, as the DRA kubeletplugin helper does; without, it says nothing until a change.
type HealthV1 struct {
	drahealthv1.UnimplementedDRAResourceHealthServer
	Send  bool
	Calls *atomic.Int32 // counts the calls, if set
}

func (h HealthV1) NodeWatchResources(_ *drahealthv1.NodeWatchResourcesRequest, s grpc.ServerStreamingServer[drahealthv1.NodeWatchResourcesResponse]) error {
	if h.Calls != nil {
		h.Calls.Add(1)
	}
	if h.Send {
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

// HealthOptions describe a DRA driver's endpoint that HealthEndpointWith serves.
type HealthOptions struct {
	// Services are the health services served: "v1" (sends at once), "v1-quiet" (says nothing
	// until a change, which never comes), "v1alpha1" (sends at once).
	Services []string
	// Delay holds every NodeWatchResources call this long (a stream interceptor) before its
	// handler runs, or until the call ends: its answer, a message or Unimplemented, comes that
	// late. With a Delay or a Hold, the versions not served are registered all the same, with
	// handlers that answer Unimplemented, as a driver built on the generated Unimplemented
	// servers does: so they pass the interceptor too. (A gRPC server answers a service it
	// does not know at once, before any interceptor.)
	Delay time.Duration
	// Hold, if set, runs in the interceptor after Delay: the call goes on when it returns.
	Hold func(ctx context.Context)
}

// HealthEndpoint serves a DRA driver's endpoint at path with the health services named (see
// HealthOptions.Services), answering at once.
func HealthEndpoint(t testing.TB, path string, services ...string) *Endpoint {
	t.Helper()
	return HealthEndpointWith(t, path, HealthOptions{Services: services})
}

// HealthEndpointWith serves a DRA driver's endpoint at path as o describes.
func HealthEndpointWith(t testing.TB, path string, o HealthOptions) *Endpoint {
	t.Helper()
	held := o.Delay > 0 || o.Hold != nil
	var opts []grpc.ServerOption
	if held {
		opts = append(opts, grpc.StreamInterceptor(func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
			ctx := ss.Context()
			wait := time.NewTimer(o.Delay)
			defer wait.Stop()
			select {
			case <-wait.C:
			case <-ctx.Done():
				return ctx.Err()
			}
			if o.Hold != nil {
				o.Hold(ctx)
			}
			return handler(srv, ss)
		}))
	}
	return ServeEndpointWith(t, path, func(srv *grpc.Server) {
		v1, v1alpha1 := false, false
		for _, svc := range o.Services {
			switch svc {
			case "v1":
				drahealthv1.RegisterDRAResourceHealthServer(srv, HealthV1{Send: true})
				v1 = true
			case "v1-quiet":
				drahealthv1.RegisterDRAResourceHealthServer(srv, HealthV1{})
				v1 = true
			case "v1alpha1":
				drahealthv1alpha1.RegisterDRAResourceHealthServer(srv, healthV1alpha1{})
				v1alpha1 = true
			default:
				t.Fatalf("unknown health service %q", svc)
			}
		}
		if held && !v1 {
			drahealthv1.RegisterDRAResourceHealthServer(srv, drahealthv1.UnimplementedDRAResourceHealthServer{})
		}
		if held && !v1alpha1 {
			drahealthv1alpha1.RegisterDRAResourceHealthServer(srv, drahealthv1alpha1.UnimplementedDRAResourceHealthServer{})
		}
	}, opts...)
}
