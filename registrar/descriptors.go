package registrar

import (
	"fmt"

	"multireg.dev/multireg/internal/regserver"
)

// Descriptors compares the file descriptors the configured drivers' registration sockets need
// with what RLIMIT_NOFILE leaves them (regserver.Budget): what /status, /readyz and the log
// say when they do not fit.
type Descriptors struct {
	regserver.Budget
	// Needed: the registration sockets the configured drivers need, one each (a DRA driver's
	// or a pattern's second socket, during a rollover, one more for a moment).
	Needed int `json:"needed"`
}

// Fits reports whether every configured driver's socket fits in the budget.
func (d Descriptors) Fits() bool { return d.Needed <= d.MaxSockets }

// Problem says what does not fit; "" when everything does.
func (d Descriptors) Problem() string {
	if d.Fits() {
		return ""
	}
	return fmt.Sprintf("file descriptors: the %d drivers need %d registration sockets, and RLIMIT_NOFILE %d leaves room for %d (%d kept for HTTP, the config, probes, kubelet's connections and accepting): %d drivers get no socket (\"no file descriptor left\" in their lastError); raise the hard limit to at least %d",
		d.Needed, d.Needed, d.Limit, d.MaxSockets, d.Reserved, d.Needed-d.MaxSockets, d.Needed+d.Reserved)
}

// Descriptors returns the descriptor budget against the configured drivers.
func (s *Supervisor) Descriptors() Descriptors {
	s.mu.Lock()
	n := len(s.running)
	s.mu.Unlock()
	return Descriptors{Budget: s.env.hub.Budget(), Needed: n}
}

// checkDescriptors warns once when the drivers stop fitting in the descriptor budget, and
// says so again should they stop fitting after they fitted.
func (s *Supervisor) checkDescriptors() {
	d := s.Descriptors()
	s.mu.Lock()
	warn := !d.Fits() && !s.unfit
	s.unfit = !d.Fits()
	s.mu.Unlock()
	if warn {
		s.log.Warn("not every driver's registration socket fits in the process's file descriptors", "problem", d.Problem(),
			"limit", d.Limit, "needed", d.Needed, "room", d.MaxSockets)
	}
}
