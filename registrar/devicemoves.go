package registrar

import (
	"log/slog"
	"sync"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/podres"
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

// dropped records that kubelet dropped resource's devices when the old instance of a move
// went.
func (m *deviceMoves) dropped(log *slog.Logger, resource string, had int) {
	_, _, run := m.view.State()
	m.mu.Lock()
	learned := m.mode == config.MovesAuto && (!m.onePerResource || m.learnedIn != run)
	m.onePerResource, m.learnedIn = true, run
	m.mu.Unlock()
	log.Warn("kubelet dropped the resource's devices when the old instance's registration went: registering the new instance again",
		"resource", resource, "devicesBefore", had)
	if learned {
		m.log.Warn("kubelet's device manager keeps one client per resource (kubelet 1.36 or older, whatever its gRPC release): " +
			"until kubelet restarts, a device plugin's new instance is registered in place of the old one's registration")
	}
}

// verification is a device plugin's move being checked in kubelet's view, from the moment the
// new instance is registered beside the old one (a rollover: loop.ro) until verifyFor after the
// old registration is withdrawn. The wait on cur records its readings (moveCheck.check); the
// transitions start and end it.
type verification struct {
	had   int       // the most devices kubelet held for the resource during the move
	gen   uint64    // the generation whose registration is verified, once the old one went
	until time.Time // zero while the old registration stays
	seen  bool      // kubelet's view answered after the withdrawal
	// decideAt: the view shows the resource without devices since a moment too recent to
	// decide (droppedFor); the wait looks again then, even if the view reads the same.
	decideAt time.Time
}

// moveCheck is a loop's verification of a device plugin's move (v; nil when none), with what
// checking it reads: the driver, and kubelet's view (moves). Only the loop's goroutine uses it.
type moveCheck struct {
	d     *driver
	moves *deviceMoves
	v     *verification
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

// viewed reports whether there is a view of kubelet to verify a move in.
func (m *moveCheck) viewed() bool { return m.moves != nil && m.moves.view != nil }

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
	m.v.gen, m.v.until = g.gen, time.Now().Add(verifyFor)
	m.moves.view.Quick(verifyFor)
}

// check reads kubelet's view for a move being verified while the loop waits on g, and records
// what it read. It returns DevicesDropped when the resource's devices dropped after the old
// registration was withdrawn while kubelet holds g (registered: the loop is Registered): g must
// be registered again; and MoveVerified when the move needs no more reading: no drop for
// verifyFor, or the move ended otherwise (another generation, or no old registration left to
// withdraw: !rolling).
func (m *moveCheck) check(g *generation, rolling, registered bool) eventKind {
	v := m.v
	if v == nil {
		return evNone
	}
	n, since, ok := m.devices()
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
	if ok && n == 0 && v.had > 0 && registered {
		if time.Since(since) >= droppedFor {
			return evDevicesDropped
		}
		v.decideAt = since.Add(droppedFor)
	}
	if !time.Now().Before(v.until) {
		return evMoveVerified
	}
	return evNone
}

// end ends the verification of a move while the loop waits on g; one that lasted its whole
// time, on g, says what it saw.
func (m *moveCheck) end(g *generation) {
	v := m.v
	m.v = nil
	if v == nil || v.until.IsZero() || time.Now().Before(v.until) || g.gen != v.gen {
		return
	}
	n, _, _ := m.devices()
	switch {
	case !v.seen:
		m.d.log.Warn("the move was not verified: kubelet's pod-resources API did not answer after the old registration was withdrawn")
	case v.had > 0:
		m.d.log.Info("kubelet kept the resource's devices through the move", "devices", n)
	}
}

// dropped ends the verification of a move whose devices kubelet dropped, and records what that
// says of kubelet.
func (m *moveCheck) dropped() {
	had := m.v.had
	m.v = nil
	m.moves.dropped(m.d.log, m.d.spec.Name, had)
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
