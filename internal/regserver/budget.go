package regserver

import (
	"fmt"
	"os"
	"sync/atomic"
	"syscall"
)

// The descriptor budget. Every registration socket holds a descriptor for as long as it is
// served, and every connection to one another. With the process's RLIMIT_NOFILE too low for
// the drivers, sockets must not take the descriptors the rest needs, or nothing answers at
// all, not even /healthz.
const (
	// SpareFDs: descriptors the registration sockets and their connections never take,
	// beyond those the process holds when its hub is made (the runtime's own, the inotify
	// instance, the HTTP listener, the lock and the hand-over socket): the HTTP server's
	// clients, the config file's reload, endpoint probes, a socket being published, and an
	// accept.
	SpareFDs = 16
	// KubeletFDs: descriptors kept for kubelet's connections to the sockets; sockets never
	// take them.
	KubeletFDs = 8
)

// Budget is the hub's descriptor budget, for /status.
type Budget struct {
	// Limit is RLIMIT_NOFILE as the process found it at start (Go raises the soft limit to
	// the hard one: the hard limit, unless something lowered the soft one since).
	Limit int `json:"limit"`
	// Reserved: kept for everything but the registration sockets (what the process held at
	// start, and SpareFDs), and for kubelet's connections (KubeletFDs).
	Reserved int `json:"reserved"`
	// MaxSockets: the registration sockets that fit.
	MaxSockets int `json:"maxSockets"`
	// Sockets and Conns: the registration sockets served (or being published), and their
	// connections.
	Sockets int `json:"sockets"`
	Conns   int `json:"connections"`
}

// NoRoomError is a registration socket the descriptor budget has no room for.
type NoRoomError struct {
	Path   string
	Budget Budget
}

func (e *NoRoomError) Error() string {
	return fmt.Sprintf("no file descriptor left for the registration socket %s: %s", e.Path, budgetText(e.Budget))
}

func budgetText(b Budget) string {
	return fmt.Sprintf("RLIMIT_NOFILE is %d, of which %d are kept for HTTP, the config, probes, kubelet's connections and accepting: room for %d registration sockets; raise the hard limit to at least the drivers' sockets + %d (the container runtime's default, or LimitNOFILE= in systemd)",
		b.Limit, b.Reserved, b.MaxSockets, b.Reserved)
}

// openFDs counts the process's open descriptors.
func openFDs() int {
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return 16
	}
	return len(fds) - 1 // ReadDir's own
}

// fdLimit returns RLIMIT_NOFILE's soft limit, the one that counts.
func fdLimit() int {
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil || rl.Cur > 1<<30 {
		return 1 << 30
	}
	return int(rl.Cur)
}

// Budget returns the descriptor budget and what is used of it.
func (h *Hub) Budget() Budget {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.budgetLocked()
}

func (h *Hub) budgetLocked() Budget {
	return Budget{Limit: h.fdLimit, Reserved: h.fdReserve + KubeletFDs, MaxSockets: h.maxSockets(), Sockets: h.nsocks, Conns: len(h.conns)}
}

func (h *Hub) budgetText() string { return budgetText(h.budgetLocked()) }

func (h *Hub) maxSockets() int { return max(0, h.fdLimit-h.fdReserve-KubeletFDs) }

// fdRoom: descriptors left for one more connection. mu is held.
func (h *Hub) fdRoom() int { return h.fdLimit - h.fdReserve - h.nsocks - len(h.conns) }

// Claim is a registration socket's descriptor, claimed before the socket is created (Claim) and
// given to Serve.
type Claim struct {
	h *Hub
	// held: the descriptor is counted in the hub's nsocks for this claim, until Serve takes it
	// (take) or Release gives it back; whichever clears it does the counting.
	held atomic.Bool
}

// Claim claims a descriptor for the registration socket at path, or fails with a NoRoomError.
func (h *Hub) Claim(path string) (*Claim, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.nsocks >= h.maxSockets() {
		return nil, &NoRoomError{Path: path, Budget: h.budgetLocked()}
	}
	h.nsocks++
	s := &Claim{h: h}
	s.held.Store(true)
	return s, nil
}

// take takes the claim for the socket being added: its descriptor is counted already. False
// when there is none to take (nil, or released): the caller counts the socket.
func (s *Claim) take() bool {
	return s != nil && s.held.CompareAndSwap(true, false)
}

// Release gives the claim back unless Serve took it. It is idempotent, and nil does nothing.
func (s *Claim) Release() {
	if !s.take() {
		return
	}
	s.h.mu.Lock()
	defer s.h.mu.Unlock()
	s.h.nsocks--
}
