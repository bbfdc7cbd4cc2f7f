package health

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"

	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
)

// Prefix is the path of a driver's check: GET /healthz/<driver name> (a device plugin's name
// holds a '/': /healthz/example.com/gpu).
const Prefix = "/healthz/"

// Handler answers GET Prefix<driver>: 200 "ok" when the driver is alive; 500 with the driver's
// error when it says it is not or does not answer in time (a driver's own livenessProbe then
// fails, as with kubernetes-csi/livenessprobe, which answers 500 too); 404 for a name that is
// not in the drivers file.
func (c *Checker) Handler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			w.Header().Set("Allow", "GET, HEAD")
			http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
			return
		}
		name, ok := strings.CutPrefix(r.URL.Path, Prefix)
		if !ok || name == "" {
			http.Error(w, "GET "+Prefix+"<driver name>", http.StatusNotFound)
			return
		}
		res, err := c.Check(r.Context(), name)
		switch {
		case errors.Is(err, ErrUnknown):
			http.Error(w, fmt.Sprintf("%s: %v", name, err), http.StatusNotFound)
		case err != nil:
			http.Error(w, fmt.Sprintf("%s: %v", name, err), http.StatusServiceUnavailable)
		case res.Err != nil:
			http.Error(w, fmt.Sprintf("%s: %v", name, res.Err), http.StatusInternalServerError)
		default:
			w.Header().Set("Content-Type", "text/plain; charset=utf-8")
			fmt.Fprintln(w, "ok")
		}
	})
}

// GRPC is the standard gRPC health service (grpc.health.v1.Health), for a driver pod's grpc
// livenessProbe: Check of service "" is multireg itself (SERVING while it runs); of a driver's
// name, that driver's check (SERVING or NOT_SERVING), and NOT_FOUND for a name that is not in
// the drivers file. Watch and List are not served: probes call Check.
type GRPC struct {
	healthpb.UnimplementedHealthServer
	c *Checker
}

// GRPC returns the gRPC health service of c's drivers.
func (c *Checker) GRPC() *GRPC { return &GRPC{c: c} }

// Check implements healthpb.HealthServer.
func (g *GRPC) Check(ctx context.Context, req *healthpb.HealthCheckRequest) (*healthpb.HealthCheckResponse, error) {
	name := req.GetService()
	if name == "" {
		return &healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING}, nil
	}
	res, err := g.c.Check(ctx, name)
	switch {
	case errors.Is(err, ErrUnknown):
		return nil, status.Errorf(codes.NotFound, "%s: %v", name, err)
	case err != nil:
		return nil, status.Errorf(codes.Unavailable, "%s: %v", name, err)
	case res.Err != nil:
		return &healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_NOT_SERVING}, nil
	}
	return &healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING}, nil
}
