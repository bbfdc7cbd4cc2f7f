//go:build linux

package main

import (
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"multireg.dev/multireg/internal/throttle"
)

// httpMaxConns bounds the HTTP server's open connections. Its clients hold one or two each:
// kubelet's probes (a connection a probe, closed after it), Prometheus (one, kept alive),
// `multireg status`. Each open connection costs some 12 KiB: 15,000 connections that never
// finish their request headers, opened within the read timeout, held 180 MiB, past the
// shipped memory limit. It is within the descriptors kept for the rest of the process
// (regserver.SpareFDs), which the registration sockets never take.
const httpMaxConns = 16

// httpStalled: a request in flight this long may be cut for a new connection. Kubelet's
// probes and Prometheus take milliseconds; the status of 1000 drivers is read in a few.
const httpStalled = time.Second

// connCap keeps the HTTP server within maxConns connections (http.Server.ConnState). A new
// connection beyond the bound closes the one that has waited the longest for a request (new,
// or idle between requests); when every other has a request in flight, the oldest of those
// in flight for stalled (a client that does not read its reply); else itself. A probe's
// connection, which sends its request at once, is served unless maxConns newer ones arrive
// before its request does, and a reply being taken is not cut.
type connCap struct {
	log *slog.Logger
	// maxConns and stalled are httpMaxConns and httpStalled (newConnCap); the package's tests
	// lower them before the server starts.
	maxConns int
	stalled  time.Duration

	// guards: conns.
	mu sync.Mutex
	// conns: every open connection, with what it is doing and since when.
	conns map[net.Conn]connUse
	// settled: closed, and nil again, once no connection is new or active (settledCh).
	settled chan struct{}
	// closed: the warning about connections closed beyond the bound (its own lock).
	closed throttle.Warning
}

// connUse is what an HTTP connection is doing: waiting for its first request (neither),
// answering one (active) or waiting for another (idle), since when.
type connUse struct {
	since        time.Time
	active, idle bool
}

// newConnCap is the cap of the daemon's HTTP server: httpMaxConns connections.
func newConnCap(log *slog.Logger) *connCap {
	return &connCap{log: log, maxConns: httpMaxConns, stalled: httpStalled, conns: map[net.Conn]connUse{},
		closed: throttle.Warning{Every: throttle.Interval}}
}

// track is the server's ConnState hook.
func (cc *connCap) track(c net.Conn, s http.ConnState) {
	cc.mu.Lock()
	defer cc.mu.Unlock()
	switch s {
	case http.StateNew:
		cc.conns[c] = connUse{since: time.Now()}
		if len(cc.conns) > cc.maxConns {
			cc.closeOne(c)
		}
	case http.StateIdle, http.StateActive:
		if _, open := cc.conns[c]; open {
			cc.conns[c] = connUse{since: time.Now(), active: s == http.StateActive, idle: s == http.StateIdle}
		}
	case http.StateHijacked, http.StateClosed:
		delete(cc.conns, c)
	}
	if cc.settled != nil && cc.isSettled() {
		close(cc.settled)
		cc.settled = nil
	}
}

// isSettled reports whether every connection is idle between requests. mu is held.
func (cc *connCap) isSettled() bool {
	for _, u := range cc.conns {
		if !u.idle {
			return false
		}
	}
	return true
}

// settledCh is closed once every connection is idle between requests (none waits for its
// first request's answer).
func (cc *connCap) settledCh() <-chan struct{} {
	cc.mu.Lock()
	defer cc.mu.Unlock()
	if cc.isSettled() {
		return closedCh
	}
	if cc.settled == nil {
		cc.settled = make(chan struct{})
	}
	return cc.settled
}

// closedCh is a closed channel.
var closedCh = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// closeOne closes a connection to make room for newest (connCap says which). mu is held.
func (cc *connCap) closeOne(newest net.Conn) {
	victim, now := newest, time.Now()
	var vu connUse
	for c, u := range cc.conns {
		if c == newest || u.active && now.Sub(u.since) < cc.stalled {
			continue
		}
		if victim == newest || vu.active && !u.active || vu.active == u.active && u.since.Before(vu.since) {
			victim, vu = c, u
		}
	}
	delete(cc.conns, victim)
	victim.Close()
	if log, n := cc.closed.Note(); log {
		cc.log.Warn("HTTP connections beyond multireg's bound closed", "bound", cc.maxConns,
			"closed", n, "next_warning_in", throttle.Interval)
	}
}
