package registrar

import (
	"fmt"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
)

// The driver's loop as a state machine: its states, the events that move it, and step, the one
// place that moves it. The package comment has the table; transitions lists it for the tests.

// state is where a driver's loop stands between two steps: what it waits for, and what the
// socket it serves (loop.cur) is to kubelet.
type state uint8

const (
	// stWaitingForEndpoint: the loop waits until the driver's endpoint answers (at once without
	// waitForEndpoint). cur, if any, is served until a new generation replaces it.
	stWaitingForEndpoint state = iota
	// stTakingOver: the loop serves sockets a hand-over gave it; once the endpoint answers, what
	// the other instance told of them decides whether they are kept (loop.takeOver).
	stTakingOver
	// stRestarting: kubelet holds cur and the driver restarted; once it answers again, its type
	// decides whether the registration stays (restart.go).
	stRestarting
	// stFallingBack: a rollover's new instance went; cur, the previous registration, is again
	// the one kubelet holds, kept once the endpoint answers if it is still the one to register.
	stFallingBack
	// stPublishing: the loop publishes a new generation.
	stPublishing
	// stAwaitingVerdict: cur is published and kubelet's verdict has not come.
	stAwaitingVerdict
	// stRegistered: kubelet registered cur.
	stRegistered
	// stBackingOff: an attempt failed; the loop waits for the next.
	stBackingOff
	// stStopped: the loop ended.
	stStopped
)

var stateNames = [...]string{
	stWaitingForEndpoint: "WaitingForEndpoint",
	stTakingOver:         "TakingOver",
	stRestarting:         "Restarting",
	stFallingBack:        "FallingBack",
	stPublishing:         "Publishing",
	stAwaitingVerdict:    "AwaitingVerdict",
	stRegistered:         "Registered",
	stBackingOff:         "BackingOff",
	stStopped:            "Stopped",
}

func (s state) String() string { return stateNames[s] }

// MarshalText names the state in JSON logs too.
func (s state) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// awaits reports whether the loop waits on cur in s (await.go).
func (s state) awaits() bool { return s == stAwaitingVerdict || s == stRegistered }

// eventKind is what moves a loop from one state to the next.
type eventKind uint8

const (
	evNone              eventKind = iota // a look that found nothing to act on
	evEndpointUp                         // the endpoint answers (or is not waited for)
	evEndpointRenamed                    // the endpoint answers under another name while cur is served
	evEndpointDown                       // the endpoint's socket went
	evEndpointRestarted                  // the endpoint's socket was created anew: the driver restarted
	evEndpointMoved                      // another socket matching the endpoint pattern is the one to register
	evPublished                          // a new generation is published
	evPublishFailed                      // it could not be
	evAccepted                           // kubelet's verdict: registered
	evRejected                           // kubelet's verdict: rejected
	evTimeout                            // no verdict within the registration timeout in force
	evSocketGone                         // cur's socket was removed or replaced by someone else
	evDevicesDropped                     // kubelet dropped a moved device plugin's devices (devicemoves.go)
	evBackoffOver                        // the backoff interval passed, or what blocked the socket's path went
	evReload                             // a new loop policy of the driver (a reload that needs no new registration)
	evRemoved                            // the driver left the configuration, or a reload restarts it
	evShutdown                           // the process stops
	evHandOff                            // the loop's sockets go to another instance (detach)
)

var eventNames = [...]string{
	evNone:              "None",
	evEndpointUp:        "EndpointUp",
	evEndpointRenamed:   "EndpointRenamed",
	evEndpointDown:      "EndpointDown",
	evEndpointRestarted: "EndpointRestarted",
	evEndpointMoved:     "EndpointMoved",
	evPublished:         "Published",
	evPublishFailed:     "PublishFailed",
	evAccepted:          "Accepted",
	evRejected:          "Rejected",
	evTimeout:           "Timeout",
	evSocketGone:        "SocketGone",
	evDevicesDropped:    "DevicesDropped",
	evBackoffOver:       "BackoffOver",
	evReload:            "Reload",
	evRemoved:           "Removed",
	evShutdown:          "Shutdown",
	evHandOff:           "HandOff",
}

func (k eventKind) String() string { return eventNames[k] }

// MarshalText names the event in JSON logs too.
func (k eventKind) MarshalText() ([]byte, error) { return []byte(k.String()), nil }

// event is an eventKind with what it carries.
type event struct {
	kind eventKind
	err  error          // Rejected, PublishFailed, EndpointRenamed: what to report
	ep   fsid.ID        // EndpointUp: the endpoint's socket as probed
	g    *generation    // Published: the new generation
	spec *config.Driver // Reload: the driver with its new loop policy
}

// anyState stands for every state but stStopped in transitions.
const anyState = stStopped + 1

// transition is one row of the table: from a state, on an event, to a state.
type transition struct {
	from state
	on   eventKind
	to   state // anyState: the state it came from
}

// transitions are every transition step makes, in the order of the package comment's table.
// Where an event leads to more than one state, the guards in step choose.
var transitions = []transition{
	{stWaitingForEndpoint, evEndpointUp, stPublishing},
	{stWaitingForEndpoint, evEndpointUp, stRegistered},
	{stWaitingForEndpoint, evEndpointRenamed, stWaitingForEndpoint},
	{stTakingOver, evEndpointUp, stRegistered},
	{stTakingOver, evEndpointUp, stAwaitingVerdict},
	{stTakingOver, evEndpointUp, stPublishing},
	{stTakingOver, evEndpointRenamed, stWaitingForEndpoint},
	{stRestarting, evEndpointUp, stRegistered},
	{stRestarting, evEndpointUp, stPublishing},
	{stRestarting, evEndpointRenamed, stWaitingForEndpoint},
	{stFallingBack, evEndpointUp, stRegistered},
	{stFallingBack, evEndpointUp, stPublishing},
	{stPublishing, evPublished, stAwaitingVerdict},
	{stPublishing, evPublishFailed, stBackingOff},
	{stAwaitingVerdict, evAccepted, stRegistered},
	{stAwaitingVerdict, evRejected, stBackingOff},
	{stAwaitingVerdict, evTimeout, stBackingOff},
	{stAwaitingVerdict, evSocketGone, stWaitingForEndpoint},
	{stAwaitingVerdict, evEndpointDown, stAwaitingVerdict},
	{stAwaitingVerdict, evEndpointRestarted, stWaitingForEndpoint},
	{stAwaitingVerdict, evEndpointMoved, stWaitingForEndpoint},
	{stAwaitingVerdict, evEndpointMoved, stFallingBack},
	{stRegistered, evAccepted, stRegistered},
	{stRegistered, evRejected, stBackingOff},
	{stRegistered, evSocketGone, stWaitingForEndpoint},
	{stRegistered, evEndpointDown, stRegistered},
	{stRegistered, evEndpointRestarted, stRestarting},
	{stRegistered, evEndpointRestarted, stWaitingForEndpoint},
	{stRegistered, evEndpointMoved, stWaitingForEndpoint},
	{stRegistered, evEndpointMoved, stFallingBack},
	{stRegistered, evDevicesDropped, stWaitingForEndpoint},
	{stBackingOff, evBackoffOver, stWaitingForEndpoint},
	{anyState, evReload, anyState},
	{anyState, evRemoved, stStopped},
	{anyState, evShutdown, stStopped},
	{anyState, evHandOff, stStopped},
}

// step moves the loop on e: it acts, and sets the state the loop goes on in. It is the only
// place that sets loop.st once the loop runs. An event that the end of the loop's context cut
// short (a look, a probe) decides nothing: the loop stops.
func (l *loop) step(e event) {
	d, from := l.d, l.st
	switch e.kind {
	case evReload:
		l.applyPolicy(*e.spec)

	case evRemoved, evShutdown, evHandOff:
		l.st = stStopped // end, deferred by run, acts on the cause: remove, keep or hand over

	case evEndpointRenamed:
		// The driver restarted under another name: kubelet must not keep it.
		if from == stRestarting {
			d.reregister()
		}
		d.log.Warn("driver reports another name; its registration is withdrawn", "err", e.err)
		d.retire(l.cur)
		l.cur, l.a = nil, nil
		l.st = stWaitingForEndpoint

	case evEndpointUp:
		d.probed = e.ep
		next := l.endpointUp(from, e.ep)
		if l.ctx.Err() != nil {
			l.st = stStopped // a look cut short by the end (a hand-over) decides nothing
			break
		}
		switch next {
		case stRegistered:
			d.update(Registered, "", time.Time{}) // the wait for the endpoint may have said otherwise
		case stAwaitingVerdict:
			d.update(Serving, "", time.Time{})
		}
		l.st = next

	case evPublished:
		switch cur := l.cur; {
		case cur == nil:
		case cur.path == e.g.path:
			cur.stop() // its file was just replaced by g's
		default:
			d.retire(cur) // kubelet deregisters it in the pass that registers g (swapsPaths)
			if l.verifySwap {
				d.verifySwap(e.g)
			}
		}
		l.verifySwap = false
		l.cur = e.g
		l.st = stAwaitingVerdict

	case evPublishFailed:
		d.record(evPublishFailed)
		l.backOff(fmt.Errorf("publish socket: %w", e.err))

	case evAccepted:
		// Taken even as the loop ends: kubelet holds the registration, and a hand-over hands it
		// over as such.
		l.w.lift()
		d.accepted(l.ctx, l.cur)
		d.settleRollover(l.ctx, l.cur)
		l.st = stRegistered

	default:
		if l.ctx.Err() != nil {
			l.st = stStopped // a look cut short by the end decides nothing
			break
		}
		l.st = l.afterWait(e)
	}
	if !l.st.awaits() {
		l.dropWaiting()
	}
	d.log.Debug("transition", "from", from, "event", e.kind, "to", l.st)
}

// endpointUp decides, once the endpoint answers in state from, what becomes of cur: kept
// (stRegistered), awaited (stAwaitingVerdict, a socket handed over while kubelet registered it)
// or replaced by a new generation (stPublishing).
func (l *loop) endpointUp(from state, ep fsid.ID) state {
	d := l.d
	switch from {
	case stTakingOver:
		a := l.a
		l.a = nil
		return l.takeOver(a, ep)
	case stRestarting:
		if l.cur.at == d.at && d.keepsRegistration(l.ctx, l.cur) {
			return stRegistered
		}
	case stFallingBack:
		switch {
		case l.cur.at == d.at:
			return stRegistered
		case d.ro == nil:
			// A newer instance answers: roll over to it from the registration kubelet holds.
			d.startRollover(l.cur)
			l.cur = nil
		}
	case stWaitingForEndpoint:
		if l.cur == nil && d.ro != nil && d.ro.prev.at == d.at {
			// The new instance's attempt failed and it went: the old one is the one to
			// register, and kubelet holds it already (a second socket for it would be refused).
			l.cur = d.fallBack()
			return stRegistered
		}
	}
	return stPublishing
}

// afterWait acts on how a wait on cur (await) or a backoff ended, and returns the next state.
func (l *loop) afterWait(e event) state {
	d, cur := l.d, l.cur
	switch e.kind {
	case evRejected:
		d.record(evRejected)
		d.remove(cur) // kubelet holds no registration of it
		l.cur = nil
		return l.backOff(e.err)
	case evTimeout:
		err := d.timedOut()
		d.record(evTimeout)
		d.retire(cur)
		l.cur = nil
		return l.backOff(err)
	case evSocketGone:
		// Recreate at once: the socket was removed or replaced by someone else.
		d.record(evSocketGone)
		cur.stop()
		d.markWithdrawn(cur.path) // kubelet holds it until its next reconcile pass
		l.cur = nil
		d.log.Info("registration socket removed or replaced; recreating it", "socket", d.spec.SocketPath)
		return stWaitingForEndpoint
	case evEndpointDown:
		// The registration stays, as with sidecars: a crashing driver must not deregister (and
		// a DRA driver's deregistration wipes its ResourceSlices after 30 s).
		d.log.Warn("driver endpoint is gone; the registration stays until it comes back", "endpoint", d.at.local)
		return l.st
	case evDevicesDropped:
		// kubelet holds cur's registration without the resource's devices: cur is registered
		// again, in a path kubelet does not hold (publishing replaces it: swapsPaths).
		d.record(evDevicesDropped)
		return stWaitingForEndpoint
	case evEndpointRestarted:
		d.countRestart()
		// The old socket is served while the driver comes up again; a new one, if the driver
		// needs one, replaces it.
		if d.keepsOnRestart(cur) {
			return stRestarting
		}
		d.reregister()
		return stWaitingForEndpoint
	case evEndpointMoved:
		return l.moved()
	case evBackoffOver:
		return stWaitingForEndpoint
	}
	d.log.Error("no transition for this event; the loop stays where it is", "state", l.st, "event", e.kind)
	return l.st
}

// moved acts on the endpoint pattern's move to another socket while cur is awaited or
// registered: a rollover to the new instance starts or falls back, or the driver is registered
// again under the new path.
func (l *loop) moved() state {
	d, cur := l.d, l.cur
	switch {
	case !d.rollsOver():
		d.reregister("why", "the endpoint moved")
		l.verifySwap = d.swapsPaths()
	case d.ro != nil && (!cur.registered || d.gone(l.ctx, cur.at)):
		if l.ctx.Err() != nil {
			return stStopped // a look cut short by the end decides nothing
		}
		// The instance being registered went, or a newer one came, before kubelet registered
		// it; or the new instance went while the old one runs: go back to the old
		// registration, which kubelet holds and whose instance answers.
		d.retire(cur)
		l.cur = d.fallBack()
		// The new instance's registration went: an older device manager dropped the
		// resource's client with it, which kubelet's view shows.
		d.withdrawn(l.cur)
		return stFallingBack
	case cur.registered:
		// kubelet holds cur: the registration stays with it until the new instance's is made.
		// An older one still kept is no longer needed.
		if d.ro != nil {
			d.retire(d.ro.prev)
		}
		d.startRollover(cur)
		l.cur = nil
		d.log.Info("driver endpoint moved; registering the new instance beside the old one")
	default:
		d.reregister("why", "the endpoint moved")
	}
	return stWaitingForEndpoint
}

// backOff records the failed attempt err and returns stBackingOff: the loop waits for the next
// attempt.
func (l *loop) backOff(err error) state {
	l.err, l.retryIn = err, l.d.failed(err)
	l.st = stBackingOff
	return stBackingOff
}
