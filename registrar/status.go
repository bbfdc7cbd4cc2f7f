package registrar

import (
	"errors"
	"io/fs"
	"maps"
	"time"
)

// Phase is where a driver's loop stands.
type Phase string

const (
	// WaitingForEndpoint: the driver's endpoint does not accept connections yet (or, for a
	// CSI driver, does not report the configured name).
	WaitingForEndpoint Phase = "WaitingForEndpoint"
	// Serving: the registration socket is published and kubelet has not answered yet.
	Serving Phase = "Serving"
	// Registered: kubelet reported a successful registration of the current socket.
	Registered Phase = "Registered"
	// BackingOff: the last attempt failed; the loop waits before it starts again.
	BackingOff Phase = "BackingOff"
)

// Phases lists every phase, in the order a loop goes through them.
var Phases = []Phase{WaitingForEndpoint, Serving, Registered, BackingOff}

// DriverStatus is a snapshot of one driver's loop.
type DriverStatus struct {
	Name     string
	Type     string
	Phase    Phase
	Socket   string
	Endpoint string
	// EndpointUp reports whether the endpoint accepted a connection at the last look.
	EndpointUp bool
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
	// NextAttempt is when a backing-off loop starts again; zero otherwise.
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

// What each event that ends an attempt, or the socket generation it published, is counted as:
// the attempt's result, and the reason its socket is recreated. An attempt cut short (its
// socket removed, its driver restarted) has no result. A driver registered again after its
// endpoint moved counts as restarted (reregister).
var (
	resultOf = map[eventKind]string{
		evAccepted:      ResultRegistered,
		evRejected:      ResultRejected,
		evTimeout:       ResultTimeout,
		evPublishFailed: ResultPublishFailed,
	}
	recreationOf = map[eventKind]string{
		evRejected:          ReasonRejected,
		evTimeout:           ReasonTimeout,
		evSocketGone:        ReasonSocketRemoved,
		evEndpointRestarted: ReasonEndpointRestarted,
		evDevicesDropped:    ReasonDevicesDropped,
	}
)

// status returns a snapshot of the loop's state.
func (d *driver) status() DriverStatus {
	d.mu.Lock()
	defer d.mu.Unlock()
	st := d.st
	st.Results = maps.Clone(d.st.Results)
	st.Recreations = maps.Clone(d.st.Recreations)
	return st
}

// record counts how an attempt or its socket generation ended, by the event that ended it.
func (d *driver) record(e eventKind) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if r, ok := resultOf[e]; ok {
		d.st.Results[r]++
	}
	if r, ok := recreationOf[e]; ok {
		d.st.Recreations[r]++
	}
}

// update sets the phase, the last error and the next attempt, and logs a phase change. While
// a rollover keeps the previous generation (d.ro), kubelet holds the driver's registration:
// the phase stays Registered whatever the new instance's attempt goes through. Only the loop's
// goroutine calls it.
func (d *driver) update(p Phase, lastErr string, nextAttempt time.Time) {
	if d.ro != nil {
		p = Registered
	}
	d.mu.Lock()
	changed := d.st.Phase != p
	if changed {
		d.st.Phase = p
		d.st.Since = time.Now()
	}
	if changed || lastErr != "" {
		d.st.HeldByOther = false // until the loop says so again (setHeldByOther)
	}
	if lastErr != "" || p == Registered && d.ro == nil {
		d.st.LastError = lastErr
	}
	d.st.NextAttempt = nextAttempt
	d.mu.Unlock()
	if changed {
		d.log.Info("phase changed", "phase", p) // the reason is logged where it arises
	}
}

// setPresence records whether the endpoint's file is there, from the error of a look at it.
func (d *driver) setPresence(statErr error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.st.Absent = errors.Is(statErr, fs.ErrNotExist)
}

// setHeldByOther records that another process serves the registration socket's path.
func (d *driver) setHeldByOther() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.st.HeldByOther = true
}

// setSocket records the registration socket the loop serves: a driver that rolls over has two.
func (d *driver) setSocket(path string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.st.Socket = path
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
	d.st.EndpointUp = up
	d.mu.Unlock()
	return changed
}
