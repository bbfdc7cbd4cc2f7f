package registrar

import (
	"context"
	"fmt"
	"slices"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	drahealthv1 "k8s.io/kubelet/pkg/apis/dra-health/v1"
	drahealthv1alpha1 "k8s.io/kubelet/pkg/apis/dra-health/v1alpha1"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/sockfile"
)

// A DRA driver's device health reaches kubelet through the DRAResourceHealth service of its
// endpoint. kubelet 1.37 and later call it only for a driver whose supportedVersions name it
// (the newest name listed that kubelet knows), and stop for good at the first Unimplemented
// answer; 1.36 called v1alpha1 for every DRA driver. The DRA kubeletplugin helper advertises
// the names of the versions it serves. multireg, which advertises for the driver, asks the
// endpoint the way kubelet will: it opens NodeWatchResources of each version, and a version
// whose call ends in Unimplemented is not served. One that sends a message, answers with
// another status or stays open without a word for healthQuiet is served: a health stream
// may say nothing until a device's health changes.

// healthQuiet is how long an open NodeWatchResources stream that neither sends nor ends counts
// as served. gRPC servers answer a service they do not serve at once, before any handler runs.
const healthQuiet = 300 * time.Millisecond

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

// healthServices returns the DRAResourceHealth services the DRA driver at path serves, of
// config.HealthServices and in their order. It fails when the endpoint does not answer gRPC.
func healthServices(ctx context.Context, path string) ([]string, error) {
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
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
// served (see healthQuiet).
func servesHealth(ctx context.Context, conn *grpc.ClientConn, service string) (bool, error) {
	sctx, stop := context.WithCancel(ctx)
	defer stop()
	stream, err := healthWatches[service](sctx, conn)
	if err == nil {
		quiet := time.AfterFunc(healthQuiet, stop)
		defer quiet.Stop()
		var resp drahealthv1.NodeWatchResourcesResponse // both versions' messages are alike; only whether one comes counts
		err = stream.RecvMsg(&resp)
	}
	switch {
	case err == nil:
		return true, nil
	case ctx.Err() != nil:
		return false, sysErr(ctx.Err())
	case sctx.Err() != nil: // open and quiet for healthQuiet
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

// versions are the versions the loop advertises: the driver's, and the health services its
// endpoint serves when it detects them.
func (d *driver) versions() []string {
	if len(d.health) == 0 {
		return d.spec.SupportedVersions
	}
	return slices.Concat(d.spec.SupportedVersions, d.health)
}

// lookHealth asks the driver's endpoint, the loop's target, whose socket is ep, which health
// services it serves, when the driver detects them (config.Driver.DetectsHealth), and keeps
// the answer for the next socket generation's GetInfo. A change is logged. The endpoint is
// asked once per socket: again only after the driver restarted (or another match of a pattern
// is the target).
func (d *driver) lookHealth(ctx context.Context, ep fsid.ID) error {
	if !d.spec.DetectsHealth() || ep != (fsid.ID{}) && ep == d.healthOf {
		return nil
	}
	var served []string
	err := d.slots.do(ctx, func() (err error) {
		served, err = healthServices(ctx, d.at.local)
		return err
	})
	if err != nil {
		return err
	}
	if !slices.Equal(served, d.health) {
		d.log.Info("device health services the DRA driver serves, advertised to kubelet", "services", served, "was", d.health)
		d.health = served
	}
	d.healthOf = ep
	return nil
}

// adoptHealth takes from a hand-over the health services the other instance advertised
// (versions, its current socket's) for the endpoint socket it last probed (ep), so that the
// loop asks the endpoint again only once that socket changes: a hand-over asks the drivers
// nothing. A predecessor that did not say what it advertised (an older release) is not taken
// at its word: the endpoint is asked.
func (d *driver) adoptHealth(versions []string, ep fsid.ID) {
	n := len(d.spec.SupportedVersions)
	if !d.spec.DetectsHealth() || versions == nil || ep == (fsid.ID{}) || len(versions) < n || !slices.Equal(versions[:n], d.spec.SupportedVersions) {
		return
	}
	d.health, d.healthOf = slices.Clone(versions[n:]), ep
}
