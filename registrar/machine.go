package registrar

import (
	"fmt"
	"slices"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
)

// The driver's loop as a state machine: its states, the events that move it, what it waits
// for in each state, and the table of transitions that step looks up. The table is the loop:
// step does what a row says and nothing else moves the loop; the package comment's table and
// docs/architecture.md's diagram are written from it (go generate; transitions_doc_test.go
// fails while they are not).
//
//go:generate go test -run ^TestTransitionDocs$ . -args -update

// state is where a driver's loop stands between two steps: what it waits for, and what the
// socket it serves (loop.cur) is to kubelet.
type state uint8

const (
	// stWaitingForEndpoint: the loop waits until the driver's endpoint answers (at once without
	// waitForEndpoint). cur, if any, is served until a new generation replaces it.
	stWaitingForEndpoint state = iota
	// stTakingOver: the loop serves sockets a hand-over gave it; once the endpoint answers, what
	// the other instance told of them decides whether they are kept (takeOver).
	stTakingOver
	// stRestarting: kubelet holds cur and the driver restarted; once it answers again, its type
	// decides whether the registration stays (restart.go).
	stRestarting
	// stFallingBack: a rollover's new instance went; cur, the previous registration, is again
	// the one kubelet holds, kept once the endpoint answers if it is still the one to register.
	stFallingBack
	// stPublishing: the loop waits until the path of its next generation is free (loop.pub),
	// then publishes it.
	stPublishing
	// stAwaitingVerdict: cur is published and kubelet's verdict has not come.
	stAwaitingVerdict
	// stRegistered: kubelet registered cur.
	stRegistered
	// stBackingOff: an attempt failed; the loop waits for the next.
	stBackingOff
	// stStopped: the loop ended.
	stStopped

	numStates
)

var stateNames = [numStates]string{
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

// eventKind is what ends a wait of the loop, and moves it.
type eventKind uint8

const (
	evNone              eventKind = iota // a look that found nothing to act on
	evEndpointUp                         // the endpoint answers (or is not waited for)
	evEndpointRenamed                    // the endpoint answers under another name while cur is served
	evEndpointDown                       // the endpoint's socket went
	evEndpointRestarted                  // the endpoint's socket was created anew: the driver restarted
	evEndpointMoved                      // another socket matching the endpoint pattern is the one to register
	evPathFree                           // the next generation's path is free: it is published
	evAccepted                           // kubelet's verdict: registered
	evRejected                           // kubelet's verdict: rejected
	evTimeout                            // no verdict within the registration timeout in force
	evSocketGone                         // cur's socket was removed or replaced by someone else
	evPrevSocketGone                     // a rollover's previous socket was removed or replaced by someone else
	evOldInstanceGone                    // a rollover's old instance is gone: its registration is no longer needed
	evDevicesDropped                     // kubelet dropped a moved device plugin's devices (devicemoves.go)
	evMoveVerified                       // a device plugin's move needs no more reading of kubelet's view
	evBackoffOver                        // the backoff interval passed, or what blocked the socket's path went
	evReload                             // a new loop policy of the driver (an edit that needs no new registration): it ends every wait
	evRemoved                            // the driver left the configuration, or an edit registers it anew
	evShutdown                           // the process stops
	evHandOver                           // the loop's sockets go to another instance, or to the loop that goes on in this one

	numEvents
)

var eventNames = [numEvents]string{
	evNone:              "None",
	evEndpointUp:        "EndpointUp",
	evEndpointRenamed:   "EndpointRenamed",
	evEndpointDown:      "EndpointDown",
	evEndpointRestarted: "EndpointRestarted",
	evEndpointMoved:     "EndpointMoved",
	evPathFree:          "PathFree",
	evAccepted:          "Accepted",
	evRejected:          "Rejected",
	evTimeout:           "Timeout",
	evSocketGone:        "SocketGone",
	evPrevSocketGone:    "PrevSocketGone",
	evOldInstanceGone:   "OldInstanceGone",
	evDevicesDropped:    "DevicesDropped",
	evMoveVerified:      "MoveVerified",
	evBackoffOver:       "BackoffOver",
	evReload:            "Reload",
	evRemoved:           "Removed",
	evShutdown:          "Shutdown",
	evHandOver:          "HandOver",
}

func (k eventKind) String() string { return eventNames[k] }

// MarshalText names the event in JSON logs too.
func (k eventKind) MarshalText() ([]byte, error) { return []byte(k.String()), nil }

// event is an eventKind with what the wait saw.
type event struct {
	kind eventKind
	err  error          // Rejected, EndpointRenamed: what to report
	up   *endpointUp    // EndpointUp: the endpoint as probed
	spec *config.Driver // Reload: the driver with its new loop policy
}

// endpointUp is what a wait for the endpoint saw when it answered.
type endpointUp struct {
	id     fsid.ID // the endpoint's socket; zero when it is not there (waitForEndpoint false)
	target target  // the socket to register: the newest match that answers, for a pattern
	// health is what the endpoint answered of the device health services it serves, when it
	// was asked (health.go); nil otherwise.
	health *healthAnswer
	// probedAt is when a probe found it ready (zero: it was not probed).
	probedAt time.Time
}

// The events that end the loop, from any state: the cause of its context's end (stopped).
var endEvents = []eventKind{evRemoved, evShutdown, evHandOver}

// anyWait are the events any wait may end on: a new policy (it ends every wait, and the loop
// takes it: Reload), and the end of the loop.
var anyWait = append([]eventKind{evReload}, endEvents...)

// waits are what the loop waits for in each state: the function that waits (wake calls it),
// and the events that end its wait, besides a new policy and the end of the loop (anyWait). A wait only
// reports what it saw; the row of the table for the state and the event acts on it.
var waits = [numStates]struct {
	wait  func(*loop) event
	emits []eventKind
}{
	stWaitingForEndpoint: {(*loop).waitEndpoint, []eventKind{evEndpointUp, evEndpointRenamed}},
	stTakingOver:         {(*loop).waitEndpoint, []eventKind{evEndpointUp, evEndpointRenamed}},
	stRestarting:         {(*loop).waitEndpoint, []eventKind{evEndpointUp, evEndpointRenamed}},
	// A DRA driver or a device plugin: only a CSI driver answers under a name.
	stFallingBack: {(*loop).waitEndpoint, []eventKind{evEndpointUp}},
	stPublishing:  {(*loop).waitPath, []eventKind{evPathFree}},
	// The registration timeout is armed only while the verdict is awaited; a rollover settles,
	// and a move's drop is repaired, only once kubelet has registered cur (await.go).
	stAwaitingVerdict: {(*loop).await, []eventKind{evAccepted, evRejected, evTimeout, evSocketGone, evPrevSocketGone,
		evEndpointDown, evEndpointRestarted, evEndpointMoved, evMoveVerified}},
	stRegistered: {(*loop).await, []eventKind{evAccepted, evRejected, evSocketGone, evPrevSocketGone, evOldInstanceGone,
		evEndpointDown, evEndpointRestarted, evEndpointMoved, evDevicesDropped, evMoveVerified}},
	stBackingOff: {(*loop).waitBackoff, []eventKind{evBackoffOver}},
	stStopped:    {}, // waits for nothing: the loop has ended
}

// reports reports whether a wait in state s may end on an event of kind k: one it declares
// (waits), a new policy or the end of the loop.
func reports(s state, k eventKind) bool {
	return slices.Contains(waits[s].emits, k) || slices.Contains(anyWait, k)
}

// anyState, in a row, stands for every state but stStopped; as a destination, for the state
// the row comes from.
const anyState = numStates

// row is one row of the table: from a state, on an event, what the loop does (act), and the
// states it may go to, each with what it means.
type row struct {
	from state
	on   eventKind
	act  func(*loop, event) state
	to   []dest
}

// dest is a state a row may go to, and what going there means.
type dest struct {
	to   state
	what string
}

// endedLook is what a row whose act looks at the endpoint says of the end of the loop's
// context cutting the look short: nothing is decided, and the next wait sees the end.
const endedLook = "nothing: the end of the loop cut the look short, and the next wait sees it"

// rows are the table, in the order of the package comment.
var rows = []row{
	{stWaitingForEndpoint, evEndpointUp, upWaiting, []dest{
		{stPublishing, "publish a generation (over the socket served, if any): where, and from when; a DRA driver's sockets kubelet may hold are withdrawn first"},
		{stRegistered, "fall back to a rollover's previous registration: its instance is the one to register, and kubelet holds it"},
	}},
	{stWaitingForEndpoint, evEndpointRenamed, renamed, []dest{{stWaitingForEndpoint, "withdraw the socket served"}}},
	{stTakingOver, evEndpointUp, takeOverDecides, []dest{
		{stRegistered, "keep the handed registration: the endpoint is the one the other instance probed, or what kubelet learnt of it holds"},
		{stAwaitingVerdict, "await the verdict kubelet owes the handed socket"},
		{stPublishing, "the driver restarted meanwhile, or a newer instance answers: publish (or roll over)"},
		{stTakingOver, endedLook},
	}},
	{stTakingOver, evEndpointRenamed, renamed, []dest{{stWaitingForEndpoint, "withdraw the handed socket"}}},
	{stRestarting, evEndpointUp, upRestarting, []dest{
		{stRegistered, "keep the registration: what kubelet learnt of the driver holds (restart.go)"},
		{stPublishing, "register again: it changed"},
		{stRestarting, endedLook},
	}},
	{stRestarting, evEndpointRenamed, renamed, []dest{{stWaitingForEndpoint, "withdraw the registration"}}},
	{stFallingBack, evEndpointUp, upFallingBack, []dest{
		{stRegistered, "keep the previous registration: its instance is the one to register"},
		{stPublishing, "roll over to a newer instance"},
	}},
	{stPublishing, evPathFree, publish, []dest{
		{stAwaitingVerdict, "publish the generation; stop serving the socket it replaced (withdraw it, in another path)"},
		{stBackingOff, "the socket could not be published: count the failure"},
	}},
	{stAwaitingVerdict, evAccepted, accepted, []dest{{stRegistered, "reset the backoff and the timeout; settle a rollover"}}},
	{stAwaitingVerdict, evRejected, rejected, []dest{{stBackingOff, "withdraw the socket, which kubelet holds none of: on kubelet 1.35 and older only a new one is tried again"}}},
	{stAwaitingVerdict, evTimeout, timedOut, []dest{{stBackingOff, "withdraw the socket; the next attempt allows longer"}}},
	{stAwaitingVerdict, evSocketGone, socketGone, []dest{{stWaitingForEndpoint, "publish again, without backoff"}}},
	{stAwaitingVerdict, evPrevSocketGone, prevSocketGone, []dest{{stAwaitingVerdict, "end the rollover: kubelet withdrew the previous registration"}}},
	{stAwaitingVerdict, evEndpointDown, endpointDown, []dest{{stAwaitingVerdict, "nothing: the socket stays"}}},
	{stAwaitingVerdict, evEndpointRestarted, endpointRestarted, []dest{{stWaitingForEndpoint, "register again"}}},
	{stAwaitingVerdict, evEndpointMoved, endpointMoved, []dest{
		{stWaitingForEndpoint, "register again under the new path"},
		{stFallingBack, "withdraw a rollover's new instance: it went, or a newer one came"},
	}},
	{stAwaitingVerdict, evMoveVerified, moveVerified, []dest{{stAwaitingVerdict, "end the move's verification"}}},
	{stRegistered, evAccepted, accepted, []dest{{stRegistered, "kubelet registered the socket again: count it"}}},
	{stRegistered, evRejected, rejected, []dest{{stBackingOff, "withdraw the socket, which kubelet holds none of now"}}},
	{stRegistered, evSocketGone, socketGone, []dest{{stWaitingForEndpoint, "publish again, without backoff"}}},
	{stRegistered, evPrevSocketGone, prevSocketGone, []dest{{stRegistered, "end the rollover: kubelet withdrew the previous registration"}}},
	{stRegistered, evOldInstanceGone, oldInstanceGone, []dest{{stRegistered, "withdraw the previous registration: the new one is registered"}}},
	{stRegistered, evEndpointDown, endpointDown, []dest{{stRegistered, "nothing: a crashing driver is not deregistered"}}},
	{stRegistered, evEndpointRestarted, endpointRestarted, []dest{
		{stRestarting, "keep serving while the driver comes up (CSI, DRA)"},
		{stWaitingForEndpoint, "register again (device plugins)"},
	}},
	{stRegistered, evEndpointMoved, endpointMoved, []dest{
		{stWaitingForEndpoint, "start a rollover beside the registration, or register again"},
		{stFallingBack, "withdraw a rollover's new instance: it went"},
		{stRegistered, endedLook},
	}},
	{stRegistered, evDevicesDropped, devicesDropped, []dest{{stWaitingForEndpoint, "register again, in a path kubelet does not hold"}}},
	{stRegistered, evMoveVerified, moveVerified, []dest{{stRegistered, "end the move's verification"}}},
	{stBackingOff, evBackoffOver, backoffOver, []dest{{stWaitingForEndpoint, "nothing"}}},
	{anyState, evReload, reload, []dest{{anyState, "take the new loop policy: a backoff or registration timeout under way is planned anew by it, and every wait from now on follows it"}}},
	{anyState, evRemoved, removed, []dest{{stStopped, "withdraw the sockets: kubelet deregisters"}}},
	{anyState, evShutdown, shutdown, []dest{{stStopped, "stop serving; the sockets stay, unless cleanup was asked for"}}},
	{anyState, evHandOver, handOver, []dest{{stStopped, "stop serving; the sockets stay, listening, and are handed over"}}},
}

// table is rows by state and event: a row of any state stands in every state but stStopped.
var table = tableOf(rows)

func tableOf(rows []row) *[numStates][numEvents]*row {
	var t [numStates][numEvents]*row
	for i := range rows {
		r := &rows[i]
		for s := range stStopped {
			if r.from == s || r.from == anyState {
				if t[s][r.on] != nil {
					panic(fmt.Sprintf("registrar: two rows from %s on %s", s, r.on))
				}
				t[s][r.on] = r
			}
		}
	}
	return &t
}

// leadsTo reports whether r may go from the state from to the state to.
func (r *row) leadsTo(from, to state) bool {
	return slices.ContainsFunc(r.to, func(d dest) bool { return d.to == to || d.to == anyState && to == from })
}

// step moves the loop on e: it does what the table's row for the loop's state and e says, and
// the loop goes on in the state the row's act returns. It is the only place that sets loop.st
// once the loop runs. A pair without a row, or an act that goes where its row does not say,
// is a programming error (TestTableIsTotal and the transition tests find each).
func (l *loop) step(e event) {
	from := l.st
	r := table[from][e.kind]
	if r == nil {
		panic(fmt.Sprintf("registrar: no transition from %s on %s: add its row to the table (machine.go)", from, e.kind))
	}
	to := r.act(l, e)
	if !r.leadsTo(from, to) {
		panic(fmt.Sprintf("registrar: the transition from %s on %s went to %s, which its row does not name", from, e.kind, to))
	}
	l.st = to
	if !to.awaits() {
		l.dropWaiting()
	}
	l.d.show(l.shown())
	l.log.Debug("transition", "from", from, "event", e.kind, "to", to)
}
