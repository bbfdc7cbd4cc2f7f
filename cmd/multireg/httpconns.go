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
	// closed: the warning about connections closed beyond the bound (its own lock).
	closed throttle.Warning
}

// connUse is what an HTTP connection is doing: waiting for a request, or answering one
// (active), since when.
type connUse struct {
	since  time.Time
	active bool
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
			cc.conns[c] = connUse{since: time.Now(), active: s == http.StateActive}
		}
	case http.StateHijacked, http.StateClosed:
		delete(cc.conns, c)
	}
}

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
