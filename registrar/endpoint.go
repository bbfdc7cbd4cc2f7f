package registrar

import (
	"context"
	"errors"
	"time"

	"github.com/cenkalti/backoff/v4"
	csi "github.com/container-storage-interface/spec/lib/go/csi"

	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/fswatch"
	"multireg.dev/multireg/internal/probe"
)

// The driver's endpoint as its loop knows it, and the wait for it to answer (waitEndpoint):
// the wait reports what it saw (EndpointUp, EndpointRenamed), and the transitions take it.
// Matching an endpoint pattern is pattern.go's, the device health services health.go's and
// what a restart keeps restart.go's.

// endpoint is the driver's endpoint as its loop knows it. Only the loop's goroutine uses it.
type endpoint struct {
	d   *driver
	env *env
	// at is the endpoint registered, or to register (pattern.go); zero for a pattern not yet
	// matched.
	at target
	// probed is the endpoint's socket as last probed ready; zero when it was not there. It
	// stays the one the registration was made or kept with until the loop takes the next
	// answer, so that a hand-over in between tells the next instance of a restart. probedAt is
	// when a probe last found it ready (zero: not probed).
	probed   fsid.ID
	probedAt time.Time
	// health is what the loop knows of the DRAResourceHealth services the endpoint serves
	// (health.go).
	health healthKnowledge
	// nodeInfo is what a CSI driver answered NodeGetInfo once kubelet registered the current
	// socket (restart.go); nil when not asked or not answered.
	nodeInfo *csi.NodeGetInfoResponse
}

func newEndpoint(d *driver, e *env) endpoint {
	ep := endpoint{d: d, env: e}
	if !d.spec.EndpointIsPattern() {
		ep.at = fixedTarget(d.spec)
	}
	return ep
}

// Probes after the endpoint's socket appears: 50ms, 100ms, … 1.6s, then the backoff.
const (
	quickProbeMin = 50 * time.Millisecond
	quickProbeMax = 1600 * time.Millisecond
)

// freshFor is how long an endpoint that a probe found ready stays ready without another probe,
// while its socket is the same file: a retry after kubelet refused the driver, or after the
// socket was removed, does not wait for a place among the probes of every other driver (the
// start-up burst of a thousand), for an answer it has just had. A driver gone meanwhile costs
// one attempt kubelet refuses.
const freshFor = 5 * time.Second

// waitEndpoint waits until the driver is ready to be registered, and reports it (EndpointUp,
// with what the wait saw), or that it answers under another name while cur is served
// (EndpointRenamed: that socket must go first).
func (l *loop) waitEndpoint() event {
	up, err := l.ep.waitUp(l.wctx, l.probeB, l.ws.ep, l.cur != nil)
	if _, renamed := errors.AsType[*probe.NameMismatchError](err); renamed {
		return event{kind: evEndpointRenamed, err: err}
	}
	if err != nil {
		return l.interrupted()
	}
	return event{kind: evEndpointUp, up: up}
}

// waitUp returns what the loop registers once the driver is ready: at once when the driver
// does not wait for its endpoint (its socket's identity zero when not there); otherwise once a
// probe of the endpoint passes, backing off between probes and probing again at once when the
// endpoint's socket is created. It fails only when ctx ends or, while a socket is served
// (serving), when the CSI driver reports another name.
func (ep *endpoint) waitUp(ctx context.Context, b *backoff.ExponentialBackOff, sub *fswatch.Subscription, serving bool) (*endpointUp, error) {
	d := ep.d
	if !d.spec.WaitForEndpoint {
		id, _, err := fsid.Stat(ep.at.local)
		d.setPresence(err)
		return &endpointUp{id: id, target: ep.at}, nil
	}
	if up := ep.fresh(); up != nil {
		return up, nil
	}
	lastErr := ""
	// After the endpoint's socket is created, a driver may still be between bind and listen,
	// or registering its services: probe again soon, a few times, before the backoff goes on.
	var quick time.Duration
	var quickFor fsid.ID // the endpoint socket a quick series was started for
	for {
		sub.Take() // what happened before this look is seen by it
		id, t, statErr, err := ep.lookTarget(ctx)
		var health *healthAnswer
		if err == nil {
			health, err = ep.askHealth(ctx, t, id)
		}
		d.setPresence(statErr)
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		if err == nil {
			if statErr != nil {
				id = fsid.ID{}
			}
			d.setEndpointUp(true)
			return &endpointUp{id: id, target: t, health: health, probedAt: time.Now()}, nil
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
		d.report(err.Error(), time.Now().Add(wait))
		if mismatch && serving {
			return nil, err
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
		woken, ok := sleepUntil(ctx, wait, sub, func(ev fswatch.Change) bool {
			if ev&fswatch.Changed != 0 { // removed, perhaps: the driver left the node
				ep.lookPresence()
			}
			return ev&(fswatch.Created|fswatch.Lost) != 0
		})
		if !ok {
			return nil, ctx.Err()
		}
		if woken {
			quick = quickProbeMin
		}
	}
}

// fresh is the endpoint as last probed ready when that was less than freshFor ago and its
// socket is still that file; nil otherwise. Only a fixed endpoint's: a pattern's newest match
// may have changed meanwhile.
func (ep *endpoint) fresh() *endpointUp {
	if ep.d.spec.EndpointIsPattern() || ep.probedAt.IsZero() || time.Since(ep.probedAt) >= freshFor {
		return nil
	}
	if id, _, err := fsid.Stat(ep.at.local); err != nil || id != ep.probed {
		return nil
	}
	ep.d.setPresence(nil)
	ep.d.setEndpointUp(true)
	return &endpointUp{id: ep.probed, target: ep.at, probedAt: ep.probedAt}
}

// takeUp makes what a wait for the endpoint saw (up) what the loop knows of the endpoint: the
// target it registers, and the device health services it serves. The socket probed (probed)
// is taken once the transition has decided what becomes of the registration.
func (ep *endpoint) takeUp(up *endpointUp) {
	ep.setTarget(up.target)
	if up.health != nil {
		ep.takeHealth(up.health)
	}
}

// lookPresence records whether the endpoint's file is there now.
func (ep *endpoint) lookPresence() {
	ep.d.setPresence(ep.present())
}

// change looks at the endpoint's socket after a wake-up (ev; 0 for a first look) and returns
// what changed: EndpointRestarted when the driver restarted (its socket was created anew, or,
// when events may have been lost, it is no longer the file probed: *probed; set here when
// zero, the socket was not there when probed), EndpointDown when the socket went since the
// last look, None otherwise. A change of attributes (a chmod) is no restart. It records
// whether the endpoint is there.
func (ep *endpoint) change(ev fswatch.Change, probed *fsid.ID) eventKind {
	d := ep.d
	id, _, err := fsid.Stat(ep.at.local)
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
