package registrar

import (
	"context"
	"errors"
	"time"

	"github.com/cenkalti/backoff/v4"
	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/fswatch"
	"multireg.dev/multireg/internal/probe"
)

// Probes after the endpoint's socket appears: 50ms, 100ms, … 1.6s, then the backoff.
const (
	quickProbeMin = 50 * time.Millisecond
	quickProbeMax = 1600 * time.Millisecond
)

// readyEndpoint returns the identity of the endpoint's socket once the driver is ready to be
// registered: at once when the driver does not wait for its endpoint (zero when the socket is
// not there), else when waitEndpoint says so.
func (d *driver) readyEndpoint(ctx context.Context, b *backoff.ExponentialBackOff, ep *fswatch.Subscription, cur *generation) (fsid.ID, error) {
	if !d.spec.WaitForEndpoint {
		id, _, err := fsid.Stat(d.at.local)
		d.setPresence(err)
		return id, nil
	}
	return d.waitEndpoint(ctx, b, ep, cur)
}

// waitEndpoint probes the endpoint until it is ready, backing off between probes and
// probing again at once when the endpoint's socket is created. It returns the endpoint's
// identity. It fails only when ctx ends or, while an older socket still serves
// (cur), when the CSI driver reports another name: that socket must go first.
func (d *driver) waitEndpoint(ctx context.Context, b *backoff.ExponentialBackOff, ep *fswatch.Subscription, cur *generation) (fsid.ID, error) {
	serving := cur != nil
	lastErr := ""
	// A restarted driver whose registration may stay (restart.go) stays Registered while it
	// comes up: kubelet still holds it. Otherwise the loop waits for its endpoint.
	phase := WaitingForEndpoint
	if d.keepsOnRestart(cur) {
		phase = Registered
	}
	// After the endpoint's socket is created, a driver may still be between bind and listen,
	// or registering its services: probe again soon, a few times, before the backoff goes on.
	var quick time.Duration
	var quickFor fsid.ID // the endpoint socket a quick series was started for
	for {
		ep.Take() // what happened before this look is seen by it
		id, statErr, err := d.lookTarget(ctx)
		if err == nil {
			err = d.lookHealth(ctx, id)
		}
		d.setPresence(statErr)
		if ctx.Err() != nil {
			return fsid.ID{}, ctx.Err()
		}
		if err == nil {
			if statErr != nil {
				id = fsid.ID{}
			}
			d.setEndpointUp(true)
			b.Reset()
			return id, nil
		}
		_, mismatch := errors.AsType[*probe.NameMismatchError](err)
		d.setEndpointUp(mismatch) // a driver that answers under another name is up
		if statErr == nil && id != quickFor {
			// A socket not seen before that does not answer yet: the driver may be between
			// bind and listen (its Create event may have come before our watch).
			quickFor, quick = id, quickProbeMin
		}
		var wait time.Duration
		if quick > 0 && quick <= quickProbeMax {
			wait, quick = quick, quick*2
		} else {
			wait = next(b)
		}
		d.update(phase, err.Error(), time.Now().Add(wait))
		if mismatch && serving {
			return fsid.ID{}, err
		}
		// Each distinct reason is a warning once; its repetitions are debug.
		if msg := err.Error(); msg != lastErr {
			lastErr = msg
			d.log.Warn("endpoint not ready", "err", err, "retryIn", wait.Round(time.Millisecond))
		} else {
			d.log.Debug("endpoint not ready", "err", err, "retryIn", wait.Round(time.Millisecond))
		}
		// Woken when the socket is created, or may have been: a watch was renewed, or moved
		// closer to it as a directory on the way appeared.
		woken, ok := sleepUntil(ctx, wait, ep, func(ev fswatch.Change) bool {
			if ev&fswatch.Changed != 0 { // removed, perhaps: the driver left the node
				d.lookPresence()
			}
			return ev&(fswatch.Created|fswatch.Lost) != 0
		})
		if !ok {
			return fsid.ID{}, ctx.Err()
		}
		if woken {
			quick = quickProbeMin
		}
	}
}

// lookPresence records whether the endpoint's file is there now.
func (d *driver) lookPresence() {
	d.setPresence(d.present())
}

// endpointChange looks at the endpoint's socket after a wake-up (ev; 0 for a first look) and
// returns what changed: EndpointRestarted when the driver restarted (its socket was created
// anew, or, when events may have been lost, it is no longer the file probed: *probed; set here
// when zero, the socket was not there when probed), EndpointDown when the socket went since the
// last look, None otherwise. A change of attributes (a chmod) is no restart. It records whether
// the endpoint is there.
func (d *driver) endpointChange(ev fswatch.Change, probed *fsid.ID) eventKind {
	id, _, err := fsid.Stat(d.at.local)
	if !d.spec.EndpointIsPattern() {
		d.setPresence(err)
	}
	if err != nil {
		if d.setEndpointUp(false) {
			return evEndpointDown
		}
		return evNone
	}
	d.setEndpointUp(true)
	if *probed == (fsid.ID{}) {
		*probed = id // not there when the socket was published (waitForEndpoint: false)
		return evNone
	}
	if ev&(fswatch.Created|fswatch.Lost|fswatch.DirGone) == 0 || id == *probed {
		return evNone
	}
	return evEndpointRestarted
}
