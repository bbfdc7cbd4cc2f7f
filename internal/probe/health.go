package probe

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	drahealthv1 "k8s.io/kubelet/pkg/apis/dra-health/v1"
	drahealthv1alpha1 "k8s.io/kubelet/pkg/apis/dra-health/v1alpha1"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/sockfile"
)

// A DRA driver serves the device health it reports to kubelet as DRAResourceHealth, in one
// or more versions. HealthServices asks the endpoint the way kubelet will: it opens
// NodeWatchResources of each version, and a version whose call ends in Unimplemented is not
// served. One that sends a message, answers with another status or stays open without a word
// for HealthQuiet is served: a health stream may say nothing until a device's health changes.

// HealthQuiet is how long an open NodeWatchResources stream that neither sends nor ends counts
// as served. gRPC servers answer a service they do not serve at once, before any handler runs.
const HealthQuiet = 300 * time.Millisecond

// healthWatches opens NodeWatchResources of each DRAResourceHealth version kubelet knows, in
// config.HealthServices' order.
var healthWatches = map[string]func(context.Context, *grpc.ClientConn) (interface{ RecvMsg(any) error }, error){
	drahealthv1.DRAResourceHealthService: func(ctx context.Context, c *grpc.ClientConn) (interface{ RecvMsg(any) error }, error) {
		return drahealthv1.NewDRAResourceHealthClient(c).NodeWatchResources(ctx, &drahealthv1.NodeWatchResourcesRequest{})
	},
	drahealthv1alpha1.DRAResourceHealthService: func(ctx context.Context, c *grpc.ClientConn) (interface{ RecvMsg(any) error }, error) {
		return drahealthv1alpha1.NewDRAResourceHealthClient(c).NodeWatchResources(ctx, &drahealthv1alpha1.NodeWatchResourcesRequest{})
	},
}

// HealthServices returns the DRAResourceHealth services the DRA driver at path serves, of
// config.HealthServices and in their order. It fails when the endpoint does not answer gRPC.
func HealthServices(ctx context.Context, path string) ([]string, error) {
	ctx, cancel := context.WithTimeout(ctx, Timeout)
	defer cancel()
	conn, err := sockfile.Client(path)
	if err != nil {
		return nil, fmt.Errorf("endpoint %s: %w", path, err)
	}
	defer conn.Close()
	var served []string
	for _, svc := range config.HealthServices {
		ok, err := servesHealth(ctx, conn, svc)
		if err != nil {
			return nil, fmt.Errorf("DRA %s/NodeWatchResources on %s: %w", svc, path, err)
		}
		if ok {
			served = append(served, svc)
		}
	}
	return served, nil
}

// servesHealth opens NodeWatchResources of service on conn and reports whether the service is
// served (see HealthQuiet).
func servesHealth(ctx context.Context, conn *grpc.ClientConn, service string) (bool, error) {
	sctx, stop := context.WithCancel(ctx)
	defer stop()
	stream, err := healthWatches[service](sctx, conn)
	if err == nil {
		quiet := time.AfterFunc(HealthQuiet, stop)
		defer quiet.Stop()
		var resp drahealthv1.NodeWatchResourcesResponse // both versions' messages are alike; only whether one comes counts
		err = stream.RecvMsg(&resp)
	}
	switch {
	case err == nil:
		return true, nil
	case ctx.Err() != nil:
		return false, sysErr(ctx.Err())
	case sctx.Err() != nil: // open and quiet for HealthQuiet
		return true, nil
	}
	switch status.Code(err) {
	case codes.Unimplemented:
		return false, nil
	case codes.Unavailable:
		return false, err // the connection failed: no answer either way
	}
	return true, nil // the driver's own answer: the service is there
}
