package registrar

import (
	"errors"
	"io/fs"
	"maps"
	"slices"
	"time"

	"multireg.dev/multireg/config"
)

// What a driver's status shows, and how its loop reports to it: the phase is derived from the
// loop's state (shownState.phase), never set; the rest is what the loop counted and saw.

// Phase is where a driver's loop stands, as its status shows it.
type Phase string

const (
	// WaitingForEndpoint: the driver's endpoint does not accept connections yet (or, for a
	// CSI driver, does not report the configured name).
	WaitingForEndpoint Phase = "WaitingForEndpoint"
	// Serving: the registration socket is published (or being published) and kubelet has not
	// answered yet.
	Serving Phase = "Serving"
	// Registered: kubelet holds the driver's registration.
	Registered Phase = "Registered"
	// BackingOff: the last attempt failed; the loop waits before it starts again.
	BackingOff Phase = "BackingOff"
)

// Phases lists every phase, in the order a loop goes through them.
var Phases = []Phase{WaitingForEndpoint, Serving, Registered, BackingOff}

// DriverStatus is a snapshot of one driver's loop.
type DriverStatus struct {
	Name string
	Type string
	// Display is what the drivers file says of the driver for status to show.
	Display  config.Display
	Phase    Phase
	Socket   string
	Endpoint string
	// EndpointUp reports whether the endpoint accepted a connection at the last look;
	// EndpointSince since when it has (or has not), as far as this process has looked (zero
	// before its first look).
	EndpointUp    bool
	EndpointSince time.Time
	// Absent reports that no file was at the endpoint's path at the last look: the driver
	// does not run on this node (or not yet). Required makes that absence fail readiness.
	Absent   bool
	Required bool
	// Attempts counts registration attempts: sockets published, and sockets that could not
	// be. Failures counts the attempts kubelet rejected or never answered, and those whose
	// socket could not be published.
	Attempts int
	Failures int
	// Results counts attempts by how they ended: registered, rejected, timeout,
	// publish_failed. An attempt cut short (its socket removed, its driver restarted) has
	// none.
	Results map[string]int
	// Recreations counts sockets recreated, by reason: rejected, timeout, socket_removed,
	// endpoint_restarted.
	Recreations map[string]int
	// EndpointRestarts counts the driver's endpoint created anew while its socket was served:
	// the driver restarted, whether its registration was kept or made again.
	EndpointRestarts int
	// InTheWay are registration paths of the driver's that something else is in (a file, or
	// another process's socket): the loop registers elsewhere (a device plugin's third path,
	// when a move's drop is repaired). Set when the loop chooses a path.
	InTheWay []string
	// HeldByOther reports that another process serves the driver's registration socket path
	// (another registrar, such as a node-driver-registrar sidecar whose driver is being moved
	// to multireg): kubelet holds that registrar's registration, and the loop waits for it to
	// go. Set while the loop backs off for it; cleared by the next failure or phase.
	HeldByOther bool
	// LastError is why the loop last backed off or waits: kubelet's own words, the endpoint
	// probe's error, or the socket problem. It is cleared on registration.
	LastError string
	// Since is when the loop entered Phase.
	Since time.Time
	// NextAttempt is when a backing-off loop starts again, or when a loop waiting for its
	// endpoint probes it next; zero otherwise.
	NextAttempt time.Time
	// Kubelet is kubelet's own view of a device plugin's resource, read from its
	// pod-resources API; nil for other types, and while the API does not answer.
	Kubelet *KubeletView
}

// Ready reports whether the driver counts as ready on this node: registered with kubelet,
// or absent from the node without being required.
func (st DriverStatus) Ready() bool {
	return st.Phase == Registered || st.Absent && !st.Required
}

// Attempt results, as counted in DriverStatus.Results and metrics.
const (
	ResultRegistered    = "registered"
	ResultRejected      = "rejected"
	ResultTimeout       = "timeout"
	ResultPublishFailed = "publish_failed"
)

// Socket recreation reasons, as counted in DriverStatus.Recreations and metrics.
const (
	ReasonRejected          = "rejected"
	ReasonTimeout           = "timeout"
	ReasonSocketRemoved     = "socket_removed"
	ReasonEndpointRestarted = "endpoint_restarted"
	// ReasonDevicesDropped: kubelet's view showed a moved device plugin's resource without
	// devices once the old instance's registration went (devicemoves.go).
	ReasonDevicesDropped = "devices_dropped"
)

// What each outcome of an attempt, or of the socket generation it published, is counted as:
// the attempt's result, and the reason its socket is recreated. An attempt cut short (its
// socket removed, its driver restarted) has no result. A driver registered again after its
// endpoint moved counts as restarted (countReregistration).
type outcome uint8

const (
	outRegistered outcome = iota
	outRejected
	outTimeout
	outPublishFailed
	outSocketGone
	outReregistered
	outDevicesDropped
)

var (
	resultOf = map[outcome]string{
		outRegistered:    ResultRegistered,
		outRejected:      ResultRejected,
		outTimeout:       ResultTimeout,
		outPublishFailed: ResultPublishFailed,
	}
	recreationOf = map[outcome]string{
		outRejected:       ReasonRejected,
		outTimeout:        ReasonTimeout,
		outSocketGone:     ReasonSocketRemoved,
		outReregistered:   ReasonEndpointRestarted,
		outDevicesDropped: ReasonDevicesDropped,
	}
)

// shownState is what a driver's status phase is derived from: the loop's state, and the
// little else that decides what kubelet holds (loop.shown).
type shownState struct {
	st      state
	rolling bool      // a rollover keeps the previous registration (loop.ro)
	waits   bool      // the loop waits for the endpoint (waitForEndpoint)
	keeps   bool      // kubelet holds cur, which a restart of the driver may keep (endpoint.keepsOnRestart)
	handed  Phase     // stTakingOver: the phase the other instance showed
	retryAt time.Time // stBackingOff: when the next attempt starts
	// unanswered: the wait for the endpoint has seen it not answer (report) since the loop
	// entered st.
	unanswered bool
}

// phase is the status phase of a loop in s, for a driver of type typ; "" keeps the phase shown
// (was). While a rollover keeps the previous registration, kubelet holds the driver's
// registration: it is Registered whatever the new instance's attempt goes through.
//
// A loop that goes back to waiting for its endpoint, or that waits to publish, shows what it
// showed until it knows better: its endpoint does not answer (WaitingForEndpoint; Registered
// while kubelet holds a registration the driver's restart may keep), or its socket is published
// (Serving). A retry after a backoff is BackingOff until then, a socket removed by someone else
// Registered: each phase is one the loop is in for more than the instant of a step.
func (s shownState) phase(was Phase) Phase {
	if s.rolling {
		return Registered
	}
	waiting := WaitingForEndpoint
	if s.keeps {
		waiting = Registered // kubelet holds the registration while the driver comes up
	}
	switch s.st {
	case stWaitingForEndpoint:
		switch {
		case !s.waits:
			return Serving // it publishes at once
		case s.unanswered:
			return waiting
		}
		return was
	case stTakingOver:
		if s.unanswered || s.handed == "" {
			return waiting
		}
		return s.handed
	case stRestarting:
		return Registered // kubelet holds the registration while the driver comes up
	case stFallingBack:
		// kubelet holds the previous registration; a device plugin's lives only while its
		// instance answers (kubelet's stream to it), which keeps says.
		if s.unanswered {
			return waiting
		}
		return Registered
	case stPublishing:
		return was
	case stAwaitingVerdict:
		return Serving
	case stRegistered:
		return Registered
	case stBackingOff:
		return BackingOff
	}
	return was // stStopped: not shown
}

// show records the loop's state, from which the status's phase is derived, and logs a change
// of phase. Entering a phase clears what the last one said (whether another process holds the
// path); the next attempt is a backoff's, if any; a registration clears the last error.
func (d *driver) show(s shownState) {
	if s.st == stStopped {
		return // the loop has ended: its status shows where it stood
	}
	d.mu.Lock()
	d.shown = s
	changed := d.derive()
	d.st.NextAttempt = s.retryAt
	p := d.st.Phase
	cleared := p == Registered && !s.rolling && d.st.LastError != ""
	if cleared {
		d.st.LastError = ""
	}
	d.mu.Unlock()
	if changed || cleared { // what a watcher reads (Changed); a step within a phase is not
		d.changes.notify()
	}
	if changed {
		d.log.Info("phase changed", "phase", p) // the reason is logged where it arises
	}
}

// derive sets the phase from what show recorded, and reports whether it changed. mu is held.
func (d *driver) derive() bool {
	p := d.shown.phase(d.st.Phase)
	if p == d.st.Phase {
		return false
	}
	d.st.Phase, d.st.Since, d.st.HeldByOther = p, time.Now(), false
	return true
}

// status returns a snapshot of the loop's state.
func (d *driver) status() DriverStatus {
	d.mu.Lock()
	defer d.mu.Unlock()
	st := d.st
	st.Results = maps.Clone(d.st.Results)
	st.Recreations = maps.Clone(d.st.Recreations)
	st.InTheWay = slices.Clone(d.st.InTheWay)
	return st
}

// record counts how an attempt or its socket generation ended.
func (d *driver) record(o outcome) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if r, ok := resultOf[o]; ok {
		d.st.Results[r]++
	}
	if r, ok := recreationOf[o]; ok {
		d.st.Recreations[r]++
	}
}

// report records that the endpoint does not answer, why (err) and when the wait for it looks
// again (next); the phase may follow (shownState.phase).
func (d *driver) report(err string, next time.Time) {
	defer d.changes.notify()
	d.mu.Lock()
	d.st.LastError, d.st.NextAttempt, d.st.HeldByOther = err, next, false
	d.shown.unanswered = true
	changed := d.derive()
	p := d.st.Phase
	d.mu.Unlock()
	if changed {
		d.log.Info("phase changed", "phase", p)
	}
}

// countFailure counts a failed attempt, err: the loop backs off. held: another process serves
// the registration socket's path (HeldByOther), which the failure says.
func (d *driver) countFailure(err string, held bool) {
	defer d.changes.notify()
	d.mu.Lock()
	defer d.mu.Unlock()
	d.st.Failures++
	d.st.LastError, d.st.HeldByOther = err, held
}

// setPresence records whether the endpoint's file is there, from the error of a look at it.
func (d *driver) setPresence(statErr error) {
	absent := errors.Is(statErr, fs.ErrNotExist)
	d.mu.Lock()
	changed := d.st.Absent != absent
	d.st.Absent = absent
	d.mu.Unlock()
	if changed {
		d.changes.notify()
	}
}

// setInTheWay records the driver's registration paths something else is in.
func (d *driver) setInTheWay(paths []string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.st.InTheWay = paths
}

// setSocket records the registration socket the loop serves: a driver that rolls over has two.
func (d *driver) setSocket(path string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.st.Socket = path
}

// setEndpoint records the endpoint the loop registers: a pattern's match, and where this
// process reaches it (a liveness check dials it: Supervisor.Target).
func (d *driver) setEndpoint(t target) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.st.Endpoint, d.local = t.endpoint, t.local
}

// countRestart counts the driver's endpoint created anew while its socket was served.
func (d *driver) countRestart() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.st.EndpointRestarts++
}

// setEndpointUp records the endpoint's state and reports whether it changed.
func (d *driver) setEndpointUp(up bool) bool {
	d.mu.Lock()
	changed := d.st.EndpointUp != up
	if changed || d.st.EndpointSince.IsZero() {
		d.st.EndpointSince = time.Now()
	}
	d.st.EndpointUp = up
	d.mu.Unlock()
	if changed {
		d.changes.notify()
	}
	return changed
}
