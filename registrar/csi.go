package registrar

import (
	"context"
	"fmt"

	csi "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/proto"

	"multireg.dev/multireg/config"
)

// A CSI driver's restart re-registers it only when what kubelet learnt at registration
// changed. kubelet's CSI handler keeps, per driver name, the endpoint it dials anew for each
// call, and records what NodeGetInfo answered at registration (node ID, max volumes per node,
// topology) in CSINode and the node's labels. A re-registration removes the driver from
// CSINode for about a second, and mounts on the node fail meanwhile; a driver that answers
// the same after its restart needs none.
//
// Device plugins and DRA drivers re-register on every restart: kubelet's device manager
// marks a plugin's resources unhealthy when its ListAndWatch stream ends and needs a new
// registration to open another; for DRA, what kubelet needs after a driver restart has not
// been measured yet.

// nodeInfoTracked reports whether the loop asks the driver NodeGetInfo once kubelet has
// registered a socket, to compare it with the answer after a restart: CSI drivers that
// multireg waits for (with waitForEndpoint false, multireg does not talk to the driver).
func nodeInfoTracked(d config.Driver) bool {
	return d.Type == config.CSIPlugin && d.WaitForEndpoint
}

// nodeInfo asks the CSI driver at the endpoint what kubelet's CSI handler asks it at
// registration.
func nodeInfo(ctx context.Context, endpoint string) (*csi.NodeGetInfoResponse, error) {
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	conn, err := grpcClient(endpoint)
	if err != nil {
		return nil, fmt.Errorf("endpoint %s: %w", endpoint, err)
	}
	defer conn.Close()
	info, err := csi.NewNodeClient(conn).NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	if err != nil {
		return nil, fmt.Errorf("CSI NodeGetInfo on %s: %w", endpoint, err)
	}
	return info, nil
}

// sameNodeInfo reports whether two NodeGetInfo answers tell kubelet the same: node ID, max
// volumes per node and accessible topology.
func sameNodeInfo(a, b *csi.NodeGetInfoResponse) bool {
	return proto.Equal(registeredPart(a), registeredPart(b))
}

// registeredPart is what kubelet records of a NodeGetInfo answer.
func registeredPart(r *csi.NodeGetInfoResponse) *csi.NodeGetInfoResponse {
	return &csi.NodeGetInfoResponse{
		NodeId:             r.GetNodeId(),
		MaxVolumesPerNode:  r.GetMaxVolumesPerNode(),
		AccessibleTopology: r.GetAccessibleTopology(),
	}
}

// recordNodeInfo asks a tracked driver NodeGetInfo once kubelet has registered its socket, for
// the comparison after a restart. It returns nil when the driver is not tracked or did not answer:
// its next restart re-registers it.
func (d *driver) recordNodeInfo(ctx context.Context) *csi.NodeGetInfoResponse {
	if !nodeInfoTracked(d.spec) {
		return nil
	}
	info, err := nodeInfo(ctx, d.spec.LocalEndpoint)
	if err != nil {
		d.log.Warn("NodeGetInfo failed; the driver's next restart registers it again", "err", err)
		return nil
	}
	return info
}

// keepsRegistration reports, after the driver restarted and answered again, whether its
// registration stays: its NodeGetInfo answer is the one recorded when kubelet registered the
// socket (registered). Otherwise the restart is counted and logged, and the loop
// registers the driver again.
func (d *driver) keepsRegistration(ctx context.Context, registered *csi.NodeGetInfoResponse) bool {
	info, err := nodeInfo(ctx, d.spec.LocalEndpoint)
	switch {
	case err != nil:
		d.reregister("err", err)
	case !sameNodeInfo(registered, info):
		d.reregister("why", "NodeGetInfo changed", "was", registeredPart(registered), "now", registeredPart(info))
	default:
		d.log.Info("driver endpoint restarted; NodeGetInfo unchanged, the registration stays", "endpoint", d.spec.LocalEndpoint)
		return true
	}
	return false
}

// reregister counts and logs a driver restart that registers the driver again.
func (d *driver) reregister(args ...any) {
	d.record(endEndpointRestarted)
	d.log.Info("driver endpoint restarted; registering again", append([]any{"endpoint", d.spec.LocalEndpoint}, args...)...)
}
