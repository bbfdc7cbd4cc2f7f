package registrar

import (
	"context"
	"slices"

	csi "github.com/container-storage-interface/spec/lib/go/csi"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/probe"
)

// What a driver's restart (its endpoint socket created anew) does to its registration, per
// type: whatever kubelet needs, and no more. A re-registration replaces the registration
// socket: kubelet unregisters the plugin and registers it one reconcile pass later (about a
// second without it).
//   - CSI: re-registered only when what kubelet learnt at registration changed. kubelet's CSI
//     handler dials the endpoint anew for each call, and records what NodeGetInfo answered at
//     registration (node ID, max volumes per node, topology) in CSINode. A re-registration
//     removes the driver from CSINode meanwhile, and mounts on the node fail.
//   - DRA: re-registered only when the driver's answer about the device health services it
//     serves changed (health.go): kubelet learns them only at registration. How soon it
//     answers within the probe's bound changes nothing, and silence keeps the earlier answer.
//     Otherwise kubelet's DRA manager keeps one gRPC connection per plugin, which reconnects
//     by itself to the restarted driver (kubelet 1.33 to 1.37); a re-registration would close
//     it and cancel the calls in flight.
//   - Device plugins: always re-registered. kubelet's device manager marks the resource's
//     devices unhealthy when the ListAndWatch stream ends, stops the plugin's endpoint, and
//     only a new registration opens another.

// keepsOnRestart reports whether the loop waits for the restarted driver to answer and then
// decides with keepsRegistration, rather than registering it again at once: only for a
// registration kubelet has accepted, cur's.
func (d *driver) keepsOnRestart(cur *generation) bool {
	if cur == nil || !cur.registered {
		return false
	}
	switch d.spec.Type {
	case config.CSIPlugin:
		return d.nodeInfo != nil
	case config.DRAPlugin:
		return true
	}
	return false
}

// nodeInfoTracked reports whether the loop asks the driver NodeGetInfo once kubelet has
// registered a socket, to compare it with the answer after a restart: CSI drivers that
// multireg waits for (with waitForEndpoint false, multireg does not talk to the driver).
func nodeInfoTracked(d config.Driver) bool {
	return d.Type == config.CSIPlugin && d.WaitForEndpoint
}

// askNodeInfo asks the driver NodeGetInfo, in one of the supervisor's probe slots.
func (d *driver) askNodeInfo(ctx context.Context) (info *csi.NodeGetInfoResponse, err error) {
	err = d.slots.Do(ctx, func() error {
		info, err = probe.NodeInfo(ctx, d.at.local)
		return err
	})
	return info, err
}

// recordNodeInfo asks a tracked driver NodeGetInfo once kubelet has registered its socket, for
// the comparison after a restart. It returns nil when the driver is not tracked or did not answer:
// its next restart re-registers it.
func (d *driver) recordNodeInfo(ctx context.Context) *csi.NodeGetInfoResponse {
	if !nodeInfoTracked(d.spec) {
		return nil
	}
	info, err := d.askNodeInfo(ctx)
	if err != nil {
		d.log.Warn("NodeGetInfo failed; the driver's next restart registers it again", "err", err)
		return nil
	}
	d.log.Debug("NodeGetInfo recorded; a restart that answers the same keeps the registration", "nodeID", info.GetNodeId())
	return info
}

// keepsRegistration reports, after the driver restarted and answered again, whether its
// registration, cur, stays: a DRA driver's when its answer gives the health services cur
// advertised (health.go); a CSI driver's when its NodeGetInfo answer is the one recorded when kubelet
// registered the socket. Otherwise the restart is counted and logged, and the loop registers
// the driver again.
func (d *driver) keepsRegistration(ctx context.Context, cur *generation) bool {
	if d.spec.Type == config.DRAPlugin {
		if was, now := cur.vers, d.versions(); !slices.Equal(was, now) {
			d.reregister("why", "the device health services it serves changed", "was", was, "now", now)
			return false
		}
		d.log.Info("driver endpoint restarted; kubelet reconnects to it by itself, the registration stays", "endpoint", d.at.local)
		return true
	}
	info, err := d.askNodeInfo(ctx)
	switch {
	case ctx.Err() != nil:
		return true // the loop ends (a hand-over): the next instance decides
	case err != nil:
		d.reregister("err", err)
	case !probe.SameNodeInfo(d.nodeInfo, info):
		d.reregister("why", "NodeGetInfo changed", "was", probe.RegisteredPart(d.nodeInfo), "now", probe.RegisteredPart(info))
	default:
		d.log.Info("driver endpoint restarted; NodeGetInfo unchanged, the registration stays", "endpoint", d.at.local)
		return true
	}
	return false
}

// reregister counts and logs a driver restart that registers the driver again.
func (d *driver) reregister(args ...any) {
	d.record(evEndpointRestarted)
	d.log.Info("driver endpoint restarted; registering again", append([]any{"endpoint", d.at.local}, args...)...)
}
