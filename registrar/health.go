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

// healthKnowledge is what a loop knows of the DRAResourceHealth services its driver's
// endpoint serves.
type healthKnowledge struct {
	// services are those advertised after the driver's versions; nil when none, or not
	// asked.
	services []string
	// known: services is what the driver answered, an instance of it asked earlier by this
	// loop, or what a hand-over told of; a silent endpoint keeps it.
	known bool
	// of is the endpoint socket they were asked of (or a hand-over told of).
	of fsid.ID
}

// healthAnswer is what a wait for the endpoint found of its health services: those served,
// decided (decideHealth), for the endpoint socket of.
type healthAnswer struct {
	services []string
	of       fsid.ID
}

// versions are the versions the loop advertises: the driver's, and the health services its
// endpoint serves when it detects them.
func (ep *endpoint) versions() []string {
	if len(ep.health.services) == 0 {
		return ep.d.spec.SupportedVersions
	}
	return slices.Concat(ep.d.spec.SupportedVersions, ep.health.services)
}

// askHealth asks the driver's endpoint at t, whose socket is id, which health services it
// serves, when the driver detects them (config.Driver.DetectsHealth): nil when it does not, or
// when id is the socket asked already (the endpoint is asked once per socket: again only after
// the driver restarted, or another match of a pattern is the target).
func (ep *endpoint) askHealth(ctx context.Context, t target, id fsid.ID) (*healthAnswer, error) {
	if !ep.d.spec.DetectsHealth() || id != (fsid.ID{}) && id == ep.health.of {
		return nil, nil
	}
	// Apart from the other probes: the driver may say nothing for the probe's whole bound, and
	// no other driver waits for that.
	var h probe.Health
	err := ep.env.healthWaits.Do(ctx, func() (err error) {
		h, err = probe.HealthServices(ctx, t.local)
		return err
	})
	if err != nil {
		return nil, err
	}
	return &healthAnswer{services: ep.decideHealth(h), of: id}, nil
}

// takeHealth keeps what the endpoint answered of its health services for the next socket
// generation's GetInfo. A change is logged.
func (ep *endpoint) takeHealth(a *healthAnswer) {
	if !slices.Equal(a.services, ep.health.services) {
		ep.d.log.Info("device health services the DRA driver serves, advertised to kubelet", "services", a.services, "was", ep.health.services)
	}
	ep.health = healthKnowledge{services: a.services, known: true, of: a.of}
}

// decideHealth returns the services h finds served: those the driver answered, and for each
// that stayed silent, what the loop knows of it, or served when it knows nothing.
func (ep *endpoint) decideHealth(h probe.Health) []string {
	log := ep.d.log
	var served []string
	for _, v := range h {
		ok := v.Served
		if v.Silent {
			if ep.health.known {
				ok = slices.Contains(ep.health.services, v.Service)
				log.Info("no answer to NodeWatchResources within the probe's bound; keeping what the driver answered before",
					"service", v.Service, "served", ok, "bound", probe.Timeout)
			} else {
				log.Info("no answer to NodeWatchResources within the probe's bound, and none before; taken as served: the stream stays open, so a handler runs",
					"service", v.Service, "bound", probe.Timeout)
			}
		}
		if ok {
			served = append(served, v.Service)
		}
	}
	return served
}

// handedHealth takes from a hand-over the health services the other instance advertised
// (versions, its current socket's) for the endpoint socket it last probed (id), so that the
// loop asks the endpoint again only once that socket changes: a hand-over asks the drivers
// nothing. A predecessor that did not say what it advertised (an older release) is not taken
// at its word: the endpoint is asked.
func (ep *endpoint) handedHealth(versions []string, id fsid.ID) {
	own := ep.d.spec.SupportedVersions
	n := len(own)
	if !ep.d.spec.DetectsHealth() || versions == nil || id == (fsid.ID{}) || len(versions) < n || !slices.Equal(versions[:n], own) {
		return
	}
	ep.health = healthKnowledge{services: slices.Clone(versions[n:]), known: true, of: id}
}
