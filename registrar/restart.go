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
func (ep *endpoint) keepsOnRestart(cur *generation) bool {
	if cur == nil || !cur.registered {
		return false
	}
	switch ep.d.spec.Type {
	case config.CSIPlugin:
		return ep.nodeInfo != nil
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

// askNodeInfo asks the driver NodeGetInfo, within the supervisor's bound on endpoint calls in flight.
func (ep *endpoint) askNodeInfo(ctx context.Context) (info *csi.NodeGetInfoResponse, err error) {
	err = ep.env.inFlight.Do(ctx, func() error {
		info, err = probe.NodeInfo(ctx, ep.at.local)
		return err
	})
	return info, err
}

// recordNodeInfo asks a tracked driver NodeGetInfo once kubelet has registered its socket, for
// the comparison after a restart, and keeps the answer: none when the driver is not tracked or
// did not answer, and its next restart re-registers it.
func (ep *endpoint) recordNodeInfo(ctx context.Context) {
	ep.nodeInfo = nil
	if !nodeInfoTracked(ep.d.spec) {
		return
	}
	info, err := ep.askNodeInfo(ctx)
	if err != nil {
		ep.d.log.Warn("NodeGetInfo failed; the driver's next restart registers it again", "err", err)
		return
	}
	ep.d.log.Debug("NodeGetInfo recorded; a restart that answers the same keeps the registration", "nodeID", info.GetNodeId())
	ep.nodeInfo = info
}

// keepsRegistration reports, after the driver restarted and answered again, whether its
// registration, cur, stays: a DRA driver's when its answer gives the health services cur
// advertised (health.go); a CSI driver's when its NodeGetInfo answer is the one recorded when
// kubelet registered the socket. Otherwise the restart is counted and logged, and the loop
// registers the driver again. decided is false when the loop's end cut the question short:
// nothing is decided.
func (ep *endpoint) keepsRegistration(ctx context.Context, cur *generation) (keeps, decided bool) {
	d := ep.d
	if d.spec.Type == config.DRAPlugin {
		if was, now := cur.vers, ep.versions(); !slices.Equal(was, now) {
			ep.countReregistration("why", "the device health services it serves changed", "was", was, "now", now)
			return false, true
		}
		d.log.Info("driver endpoint restarted; kubelet reconnects to it by itself, the registration stays", "endpoint", ep.at.local)
		return true, true
	}
	info, err := ep.askNodeInfo(ctx)
	switch {
	case ctx.Err() != nil:
		return false, false // the loop ends (a hand-over): the next instance decides
	case err != nil:
		ep.countReregistration("err", err)
	case !probe.SameNodeInfo(ep.nodeInfo, info):
		ep.countReregistration("why", "NodeGetInfo changed", "was", probe.RegisteredPart(ep.nodeInfo), "now", probe.RegisteredPart(info))
	default:
		d.log.Info("driver endpoint restarted; NodeGetInfo unchanged, the registration stays", "endpoint", ep.at.local)
		return true, true
	}
	return false, true
}

// countReregistration counts and logs a driver restart (or a move of its endpoint) after which
// the loop registers the driver again: the transition that follows publishes the new socket.
func (ep *endpoint) countReregistration(args ...any) {
	ep.d.record(outReregistered)
	ep.d.log.Info("driver endpoint restarted; registering again", append([]any{"endpoint", ep.at.local}, args...)...)
}
