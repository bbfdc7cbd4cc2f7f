package registrar

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/podres"
	"multireg.dev/multireg/internal/probe"
)

// How a device plugin moves to a new endpoint (an endpoint pattern's new instance) depends
// on kubelet's device manager, and nothing kubelet sends names it:
//   - kubelet 1.37 and later keep several endpoints per resource, keyed by socket, and
//     promote a remaining one when one goes. Registering the new instance beside the old one,
//     and withdrawing the old registration once its instance is gone, keeps the resource's
//     devices allocatable throughout.
//   - kubelet 1.36 and older keep one client per resource name: the second registration
//     replaces the first, and the end of either instance's stream, or the withdrawal of
//     either registration, disconnects whichever client kubelet holds. Registered beside the
//     old one, the new instance loses its devices when the old one goes.
//
// multireg does not guess which kubelet it serves. With kubelet's pod-resources API at hand
// (podres), it registers the new instance beside the old one and then reads what kubelet did:
// if the resource's devices dropped once the old instance went, it registers the new instance
// again at once, and from then on registers a moving plugin's new instance in place of the old
// one's registration, as soon as the new instance answers. Without the API it does the latter
// from the start: it costs kubelet's device manager a moment without the resource on a kubelet
// that would have kept it, and never strands a resource on one that would not.
//
// In place of the old registration, and registering again, both mean: the new socket in the
// path kubelet does not hold, the socket it holds removed right after (swapsPaths). kubelet
// deregisters the old socket and registers the new one in the same reconcile pass,
// deregistering first, so the device manager's client for the resource is replaced within the
// pass; the old instance, deregistered while it runs, leaves nothing behind to disconnect the
// new client when it exits. Re-registered in the same path, the resource would wait a second
// pass.

// verifyFor is how long a loop reads kubelet's view after withdrawing the old registration of
// a device plugin registered beside it: kubelet deregisters the old socket within one
// reconcile pass (an older device manager then disconnects the resource's client), and the
// read that shows it comes within another.
const verifyFor = 2 * podres.Period

// droppedFor is how long kubelet's view must show the resource without devices before a drop
// is taken for one: two quick reads, so that one odd answer decides nothing.
const droppedFor = 2 * podres.QuickPeriod

// deviceMoves is what a supervisor's loops know of how kubelet takes a device plugin's move.
type deviceMoves struct {
	mode config.DeviceMoves
	view *podres.View // nil: none
	log  *slog.Logger

	// guards: onePerResource, learnedIn.
	mu sync.Mutex
	// onePerResource: kubelet was seen to drop a resource's devices when the old instance of
	// a move went (MovesAuto then registers new instances after the old ones), in the
	// learnedIn-th run of kubelet's API the view saw: a kubelet restarted since (maybe
	// upgraded) is asked again.
	onePerResource bool
	learnedIn      int
}

// beside reports whether a device plugin's new instance is registered beside the old one.
func (m *deviceMoves) beside() bool {
	if m == nil {
		return false
	}
	switch m.mode {
	case config.MovesBeside:
		return true
	case config.MovesAfter:
		return false
	}
	_, up, run := m.view.State()
	m.mu.Lock()
	defer m.mu.Unlock()
	return up && (!m.onePerResource || m.learnedIn != run)
}

// learn records that kubelet, in its run-th run, dropped a resource's client when the old
// instance of a move went and took the new instance's devices once it was registered again:
// its device manager keeps one client per resource. Nothing else teaches it: not a count of
// devices alone, which a new instance that reports them unhealthy or late lowers too.
func (m *deviceMoves) learn(run int) {
	m.mu.Lock()
	learned := m.mode == config.MovesAuto && (!m.onePerResource || m.learnedIn != run)
	m.onePerResource, m.learnedIn = true, run
	m.mu.Unlock()
	if learned {
		m.log.Warn("kubelet's device manager keeps one client per resource (kubelet 1.36 or older, whatever its gRPC release): " +
			"until kubelet restarts, a device plugin's new instance is registered in place of the old one's registration")
	}
}

// verification is a device plugin's move being checked in kubelet's view, from the moment the
// new instance is registered beside the old one (a rollover: loop.ro) until verifyFor after the
// old registration is withdrawn; or, after a drop, the repair's registration checked for
// verifyFor (repair). The wait on cur records its readings (moveCheck.check); the transitions
// start and end it.
type verification struct {
	had   int       // the most devices kubelet held for the resource during the move
	gen   uint64    // the generation whose registration is verified, once the old one went
	until time.Time // zero while the old registration stays
	// withdrawnAt: when the old registration was withdrawn. A view without devices counts as
	// a drop from then only: kubelet shows none as soon as the old instance dies, through the
	// old registration, before multireg withdraws it.
	withdrawnAt time.Time
	seen        bool // kubelet's view answered after the withdrawal
	// decideAt: the view shows the resource without devices since a moment too recent to
	// decide (droppedFor), or the plugin reported none healthy a pass ago; the wait looks again
	// then, even if the view reads the same.
	decideAt time.Time
	// agreed: kubelet held no device while the new instance reported none healthy: no drop.
	agreed bool
	// repair: the registration that repaired a drop in run, which restored: kubelet took the
	// new instance's devices once it was registered again.
	repair   bool
	run      int
	restored bool
}

// moveCheck is a loop's verification of a device plugin's move (v; nil when none), with what
// checking it reads: the driver, kubelet's view (moves) and the plugin's own report (env).
// Only the loop's goroutine uses it.
type moveCheck struct {
	d     *driver
	env   *env
	moves *deviceMoves
	v     *verification
	// dropRun is the run of kubelet in which a drop was repaired, for the repair's check
	// (startRepair); 0: none pending.
	dropRun int
	dropHad int
}

// devices is what kubelet's view says of the driver's resource: its allocatable devices,
// since when, and whether the view has read kubelet and it answers.
func (m *moveCheck) devices() (int, time.Time, bool) {
	if m.moves == nil {
		return 0, time.Time{}, false
	}
	r, up, _ := m.moves.view.State()
	n, since, ok := r.Count(m.d.spec.Name)
	return n, since, ok && up
}

// viewed reports whether there is a view of kubelet to verify a move in: one that answers. (A
// view that does not answer said so once, in its own log line; a move then goes as without
// one.)
func (m *moveCheck) viewed() bool { return m.moves != nil && m.moves.view.Available() }

// start begins watching kubelet's view for a device plugin whose new instance is being
// registered beside the old one (rolling: a rollover keeps the old registration); without a
// view there is nothing to watch.
func (m *moveCheck) start(rolling bool) {
	m.v = nil
	if m.d.spec.Type != config.DevicePlugin || !m.viewed() || !rolling {
		return
	}
	n, _, _ := m.devices()
	m.v = &verification{had: n}
}

// startSwap begins verifying a device plugin's move registered in the other path while its
// old registration's socket went (swapsPaths): kubelet's view is read quickly for verifyFor,
// and a drop registers the new instance again, once (the registration that repairs a drop is
// not verified in turn).
func (m *moveCheck) startSwap(g *generation) {
	m.v = nil
	if !m.viewed() {
		return
	}
	n, _, _ := m.devices()
	m.v = &verification{had: n}
	m.withdrawn(g)
}

// withdrawn notes that the old registration of a verified move was withdrawn while g is the
// registration kubelet holds: kubelet's view is read quickly for verifyFor.
func (m *moveCheck) withdrawn(g *generation) {
	if m.v == nil {
		return
	}
	now := time.Now()
	m.v.gen, m.v.until, m.v.withdrawnAt = g.gen, now.Add(verifyFor), now
	m.moves.view.Quick(verifyFor)
}

// check reads kubelet's view for a move being verified while the loop waits on g, and records
// what it read. It returns DevicesDropped when, once the old registration was withdrawn while
// kubelet holds g (registered: the loop is Registered), kubelet holds none of the resource's
// devices while the new instance reports some healthy (plugin): kubelet has dropped its
// client, and g must be registered again; and MoveVerified when the move needs no more reading:
// no drop for verifyFor, the move ended otherwise (another generation, or no old registration
// left to withdraw: !rolling), or a repair's registration brought the devices back. A new
// instance that reports no healthy device (unhealthy, or not yet) explains kubelet's view:
// no drop.
func (m *moveCheck) check(ctx context.Context, g *generation, rolling, registered bool) eventKind {
	v := m.v
	if v == nil {
		return evNone
	}
	n, since, ok := m.devices()
	if v.repair {
		switch _, _, run := m.moves.view.State(); {
		case ok && n > 0 && time.Since(since) >= droppedFor && run == v.run:
			v.restored = true
			return evMoveVerified
		case ok && n > 0 && run == v.run:
			v.decideAt = since.Add(droppedFor) // restored two readings running, not one
		case !time.Now().Before(v.until):
			return evMoveVerified
		}
		return evNone
	}
	if v.until.IsZero() { // the old registration stays: kubelet holds the resource through it
		if !rolling {
			return evMoveVerified // the move ended without a withdrawal to verify
		}
		if ok {
			v.had = max(v.had, n)
		}
		return evNone
	}
	if g.gen != v.gen {
		return evMoveVerified // another generation since: nothing of the move to verify
	}
	v.seen = v.seen || ok
	if ok {
		v.had = max(v.had, n) // a view read before the move may not have shown them yet
	}
	v.decideAt = time.Time{}
	since = later(since, v.withdrawnAt)
	if ok && n == 0 && v.had > 0 && registered {
		switch {
		case time.Since(since) < droppedFor:
			v.decideAt = since.Add(droppedFor)
		default:
			healthy, all, err := m.pluginDevices(ctx, g)
			if err == nil && healthy == 0 {
				// kubelet holds what the new instance reports: no device healthy, or none yet.
				if !v.agreed {
					m.d.log.Info("kubelet holds none of the resource's devices, and the new instance reports none healthy: not a drop",
						"devices", all)
				}
				v.agreed = true
				v.decideAt = time.Now().Add(podres.Period) // asked again a pass later
				break
			}
			if err != nil {
				m.d.log.Info("the new instance's own report of its devices could not be read; kubelet's view alone decides the drop", "err", err)
			}
			return evDevicesDropped
		}
	}
	if !time.Now().Before(v.until) {
		return evMoveVerified
	}
	return evNone
}

// pluginDevices is what the device plugin serving g reports of its devices (probe.HealthyDevices),
// asked within the supervisor's bound on endpoint calls in flight.
func (m *moveCheck) pluginDevices(ctx context.Context, g *generation) (healthy, all int, err error) {
	err = m.env.inFlight.Do(ctx, func() error {
		healthy, all, err = probe.HealthyDevices(ctx, g.at.local)
		return err
	})
	return healthy, all, err
}

// end ends the verification of a move while the loop waits on g; one that lasted its whole
// time, on g, says what it saw. A repair's that restored the devices teaches what kubelet's
// device manager does (deviceMoves.learn).
func (m *moveCheck) end(g *generation) {
	v := m.v
	m.v = nil
	switch {
	case v == nil:
		return
	case v.repair && v.restored:
		m.moves.learn(v.run)
		return
	case v.repair:
		m.d.log.Info("kubelet did not take the new instance's devices after it was registered again: what its device manager does is not learnt from this move")
		return
	}
	if v.until.IsZero() || time.Now().Before(v.until) || g.gen != v.gen {
		return
	}
	n, _, _ := m.devices()
	switch {
	case v.agreed:
		m.d.log.Info("the move verified: the new instance reports no healthy device, and kubelet holds none")
	case !v.seen:
		m.d.log.Warn("the move was not verified: kubelet's pod-resources API did not answer after the old registration was withdrawn")
	case v.had > 0:
		m.d.log.Info("kubelet kept the resource's devices through the move", "devices", n)
	}
}

// dropped ends the verification of a move whose devices kubelet dropped: the new instance is
// registered again, and that registration is checked (startRepair) before anything is learnt.
func (m *moveCheck) dropped() {
	had := m.v.had
	m.v = nil
	_, _, m.dropRun = m.moves.view.State()
	m.dropHad = had
	m.d.log.Warn("kubelet dropped the resource's devices when the old instance's registration went: registering the new instance again",
		"resource", m.d.spec.Name, "devicesBefore", had)
}

// startRepair begins checking the registration of g that repairs a drop, if one was repaired:
// kubelet's view is read quickly for verifyFor.
func (m *moveCheck) startRepair(g *generation) {
	if m.dropRun == 0 {
		return
	}
	m.v = &verification{repair: true, run: m.dropRun, had: m.dropHad, gen: g.gen, until: time.Now().Add(verifyFor)}
	m.dropRun, m.dropHad = 0, 0
	m.moves.view.Quick(verifyFor)
}

// watchView returns what wakes a wait while a device plugin's move is verified: kubelet's view
// changing; nil otherwise. It is taken before the view is read, so that a reading in between
// wakes the next select.
func (m *moveCheck) watchView() <-chan struct{} {
	if m.v == nil {
		return nil
	}
	return m.moves.view.Changed()
}

// timer returns what fires when a verified move needs a look though the view reads the same:
// the end of the verification, or the moment a drop seen too recently can be decided; nil when
// no move is verified, or while the old registration stays. The timer is w's.
func (m *moveCheck) timer(w *waiting) <-chan time.Time {
	v := m.v
	if v == nil || v.until.IsZero() {
		return nil
	}
	at := v.until
	if !v.decideAt.IsZero() && v.decideAt.Before(at) {
		at = v.decideAt
	}
	if w.verifyEnd == nil {
		w.verifyEnd = time.NewTimer(time.Until(at))
	} else {
		w.verifyEnd.Reset(time.Until(at))
	}
	return w.verifyEnd.C
}

// later is the later of a and b.
func later(a, b time.Time) time.Time {
	if a.Before(b) {
		return b
	}
	return a
}
