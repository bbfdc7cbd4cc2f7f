package probe

import (
	"context"
	"errors"
	"fmt"
	"sync"

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
// NodeWatchResources of every version at once, on one connection, and waits for the driver's
// answer within Timeout, one bound for the whole probe. The answer decides, however late it
// comes within the bound:
//   - a message, or a status other than Unimplemented and Unavailable: served;
//   - Unimplemented: not served (kubelet stops watching for good at this answer);
//   - Unavailable, the connection failed: no answer either way, an error.
//
// A stream still open without a word at the end of the bound is silence, which is no answer:
// the verdict says so (HealthVerdict.Silent). A gRPC server answers a service or method it does
// not serve with Unimplemented before any handler or interceptor runs, so an open stream is a
// handler that runs, and a health stream may legitimately say nothing until a device's health
// changes: kubelet itself waits on such a stream for as long as it stays open. That is an
// inference, though (an interceptor, a handler built on the generated Unimplemented server, or
// a proxy's unknown-service handler can answer Unimplemented later than any bound), so the
// caller decides what silence gets; it takes it as served only when it has no earlier answer
// of the driver's to keep. An endpoint whose connection never gets as far as an open stream
// (nothing speaks gRPC on it) does not answer at all: an error.

// errSilent ends a probe's streams at the end of its bound.
var errSilent = errors.New("no answer within the probe's bound")

// HealthVerdict is what one DRAResourceHealth service's NodeWatchResources came to.
type HealthVerdict struct {
	Service string // of config.HealthServices
	// Served: the driver answered with a message or a status other than Unimplemented; or
	// (Silent) it said nothing.
	Served bool
	// Silent: the stream stayed open without an answer until the end of the bound; Served
	// is then the inference that a handler runs, not the driver's answer.
	Silent bool
}

// Health is the verdict of each of config.HealthServices, in their order.
type Health []HealthVerdict

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

// HealthServices asks the DRA driver at path which of config.HealthServices it serves, all
// at once within Timeout. It fails when the endpoint does not answer gRPC, or the connection
// fails.
func HealthServices(ctx context.Context, path string) (Health, error) {
	conn, err := sockfile.Client(path)
	if err != nil {
		return nil, fmt.Errorf("endpoint %s: %w", path, err)
	}
	defer conn.Close()
	bound, stop := context.WithTimeoutCause(ctx, Timeout, errSilent)
	defer stop()
	// The first failure ends the other calls: the probe has failed.
	calls, fail := context.WithCancelCause(bound)
	defer fail(nil)
	h := make(Health, len(config.HealthServices))
	errs := make([]error, len(h))
	var wg sync.WaitGroup
	for i, svc := range config.HealthServices {
		wg.Go(func() {
			h[i], errs[i] = watchHealth(calls, conn, svc)
			if errs[i] != nil {
				errs[i] = fmt.Errorf("DRA %s/NodeWatchResources on %s: %w", svc, path, errs[i])
				fail(errs[i])
			}
		})
	}
	wg.Wait()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if err := context.Cause(calls); err != nil && !errors.Is(err, errSilent) {
		return nil, err // the first call that failed
	}
	for _, err := range errs {
		if err != nil {
			return nil, err // no stream opened within the bound
		}
	}
	return h, nil
}

// watchHealth opens NodeWatchResources of service on conn and waits for the driver's answer
// until ctx ends. Its verdict: see HealthServices.
func watchHealth(ctx context.Context, conn *grpc.ClientConn, service string) (HealthVerdict, error) {
	v := HealthVerdict{Service: service}
	// The call carries no deadline, as kubelet's does not: the driver's handler sees the
	// stream kubelet will open, and ends it only when the probe cancels it.
	call, cancel := context.WithCancel(context.WithoutCancel(ctx))
	defer cancel()
	defer context.AfterFunc(ctx, cancel)()
	stream, err := healthWatches[service](call, conn)
	if err != nil { // not even a stream: the endpoint does not speak gRPC, or not in time
		if errors.Is(context.Cause(ctx), errSilent) {
			return v, sysErr(context.DeadlineExceeded)
		}
		return v, callErr(ctx, err)
	}
	var resp drahealthv1.NodeWatchResourcesResponse // both versions' messages are alike; only whether one comes counts
	err = stream.RecvMsg(&resp)
	code := status.Code(err)
	switch {
	case err == nil:
		v.Served = true
	case code == codes.Unimplemented:
	case errors.Is(context.Cause(ctx), errSilent): // open and silent until the bound ended it
		v.Served, v.Silent = true, true
	case ctx.Err() != nil:
		return v, callErr(ctx, err)
	case code == codes.Unavailable:
		return v, err // the connection failed: no answer either way
	default: // the driver's own answer (a stream it ended, too): the service is there
		v.Served = true
	}
	return v, nil
}

// callErr is a call's error once ctx may have ended it: ctx's cause when it did.
func callErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return context.Cause(ctx)
	}
	return err
}
