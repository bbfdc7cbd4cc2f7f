package registrar

import (
	"context"
	"slices"

	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/probe"
)

// A DRA driver's device health reaches kubelet through the DRAResourceHealth service of its
// endpoint. kubelet 1.37 and later call it only for a driver whose supportedVersions name it
// (the newest name listed that kubelet knows), and stop for good at the first Unimplemented
// answer; 1.36 called v1alpha1 for every DRA driver. The DRA kubeletplugin helper advertises
// the names of the versions it serves. multireg, which advertises for the driver, asks the
// endpoint which it serves (probe.HealthServices) and lists them after the driver's versions.
//
// The driver's answer decides, however late it comes within the probe's bound: the same
// release advertises the same services whether it answers at once or slowly, and a restart
// into it registers nothing again (restart.go). A service whose stream stays silent for the
// whole bound keeps what the loop knows of the driver: what an earlier instance answered, or
// what a hand-over told. With nothing known, silence counts as served (probe.HealthServices
// says why), and the log says that silence decided.

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
	var h probe.Health
	err := d.slots.Do(ctx, func() (err error) {
		h, err = probe.HealthServices(ctx, d.at.local)
		return err
	})
	if err != nil {
		return err
	}
	served := d.decideHealth(h)
	if !slices.Equal(served, d.health) {
		d.log.Info("device health services the DRA driver serves, advertised to kubelet", "services", served, "was", d.health)
	}
	d.health, d.healthKnown, d.healthOf = served, true, ep
	return nil
}

// decideHealth returns the services h finds served: those the driver answered, and for each
// that stayed silent, what the loop knows of it, or served when it knows nothing.
func (d *driver) decideHealth(h probe.Health) []string {
	var served []string
	for _, v := range h {
		ok := v.Served
		if v.Silent {
			if d.healthKnown {
				ok = slices.Contains(d.health, v.Service)
				d.log.Info("no answer to NodeWatchResources within the probe's bound; keeping what the driver answered before",
					"service", v.Service, "served", ok, "bound", probe.Timeout)
			} else {
				d.log.Info("no answer to NodeWatchResources within the probe's bound, and none before; taken as served: the stream stays open, so a handler runs",
					"service", v.Service, "bound", probe.Timeout)
			}
		}
		if ok {
			served = append(served, v.Service)
		}
	}
	return served
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
	d.health, d.healthKnown, d.healthOf = slices.Clone(versions[n:]), true, ep
}
