package testkit

import (
	"sync/atomic"
	"testing"

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

// HealthEndpoint serves a DRA driver's endpoint at path with the health services named.
func HealthEndpoint(t testing.TB, path string, services ...string) *Endpoint {
	t.Helper()
	return ServeEndpoint(t, path, func(srv *grpc.Server) {
		for _, svc := range services {
			switch svc {
			case "v1":
				drahealthv1.RegisterDRAResourceHealthServer(srv, HealthV1{Send: true})
			case "v1-quiet":
				drahealthv1.RegisterDRAResourceHealthServer(srv, HealthV1{})
			case "v1alpha1":
				drahealthv1alpha1.RegisterDRAResourceHealthServer(srv, healthV1alpha1{})
			default:
				t.Fatalf("unknown health service %q", svc)
			}
		}
	})
}
