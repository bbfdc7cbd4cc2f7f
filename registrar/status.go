package registrar

import "time"

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
	// Attempts counts published registration sockets; Failures counts attempts kubelet
	// rejected or never answered, and sockets that could not be published.
	Attempts int
	Failures int
	// LastError is why the loop last backed off or waits: kubelet's own words, the endpoint
	// probe's error, or the socket problem. It is cleared on registration.
	LastError string
	// Since is when the loop entered Phase.
	Since time.Time
	// NextAttempt is when a backing-off loop starts again; zero otherwise.
	NextAttempt time.Time
}
