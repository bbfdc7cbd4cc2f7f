package registrar

import (
	"context"
	"errors"
	"net"
	"time"

	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/fswatch"
	"multireg.dev/multireg/internal/regdir"
	"multireg.dev/multireg/internal/regserver"
	"multireg.dev/multireg/internal/sockfile"
)

// A loop's sockets: publishing a generation, retiring one, and backing off after a failure.

// shutdown stops the current generation when the loop ends. The socket is removed when the
// driver left the configuration, or on shutdown with cleanup; otherwise it stays, so that a
// restarting multireg does not deregister every plugin at once. After the directory was lost
// to another instance nothing is removed: the sockets are that instance's.
func (d *driver) shutdown(cause error, cur *generation) {
	if errors.Is(cause, errHandOff) {
		d.handed = d.detach(cur)
		return
	}
	remove := errors.Is(cause, errRemoved) || d.cleanup && !errors.Is(cause, regdir.ErrDirLost)
	for _, g := range []*generation{d.prevGeneration(), cur} {
		switch {
		case g == nil:
		case remove:
			d.retire(g)
		default:
			g.stop()
		}
	}
	d.ro = nil
	if !remove {
		return
	}
	// A socket left by an earlier run of multireg that this run never replaced.
	for _, path := range d.spec.SocketPaths() {
		d.removeStale(path)
	}
	d.log.Info("registration socket removed; kubelet deregisters the plugin", "socket", d.spec.SocketPath)
}

// removeStale removes a socket at path that no one serves (see sockfile.RemoveStale), and logs why it
// could not.
func (d *driver) removeStale(path string) {
	if err := sockfile.RemoveStale(path); err != nil {
		d.log.Warn("remove stale registration socket", "socket", path, "err", err)
	}
}

// retire stops a generation and removes its socket, so that kubelet deregisters it.
func (d *driver) retire(g *generation) {
	if d.remove(g) {
		d.markWithdrawn(g.path) // kubelet may hold it for a moment
	}
}

// remove stops a generation and removes its socket, and reports whether it did: retire for a
// generation kubelet holds no registration of, such as one it rejected (its failed
// registration is no longer in its actual state from 1.36, and held nothing in its handler
// before), whose next socket may follow at once.
func (d *driver) remove(g *generation) bool {
	g.stop()
	removed, err := sockfile.RemoveIfOurs(g.path, g.id)
	if err != nil {
		d.log.Warn("remove registration socket", "socket", g.path, "err", err)
	}
	return removed
}

// publish creates the next socket generation at path and serves it. cur, if not nil, is the
// loop's current generation, whose socket may be at path: only a socket of ours is replaced.
func (d *driver) publish(path string, cur *generation) (*generation, error) {
	// The new generation is current before its socket can be dialled, so that no verdict
	// for it is mistaken for a stale one.
	// The attempt is counted before the socket is visible, so that whoever sees the socket
	// sees the attempt too.
	d.mu.Lock()
	prev := d.gen
	d.lastGen++
	gen := d.lastGen
	d.gen = gen
	d.pending = nil
	d.st.Attempts++
	d.mu.Unlock()

	var id fsid.ID
	err := d.checkGuard()
	if err == nil {
		var ours fsid.ID
		if cur != nil && cur.path == path {
			ours = cur.id
		}
		err = sockfile.CheckNotServed(path, ours)
	}
	var claim *regserver.Slot
	if err == nil {
		// The socket's descriptor, claimed before it is created: sockets never take the
		// descriptors the rest of the process needs.
		claim, err = d.hub.Claim(path)
	}
	defer claim.Release()
	var g *generation
	if err == nil {
		// Served before it is renamed onto path: a failure to serve must not replace cur.
		_, id, err = sockfile.Publish(path, func(l *net.UnixListener) (func(), error) {
			var err error
			g, err = d.serveClaimed(l, path, fsid.ID{}, gen, d.at, d.versions(), false, claim)
			if err != nil {
				return nil, err
			}
			return g.stop, nil
		})
	}
	if err != nil {
		// An older socket may still serve (a driver restart): its verdicts count again.
		d.mu.Lock()
		if d.gen == gen {
			d.gen = prev
		}
		d.mu.Unlock()
		return nil, err
	}
	g.id = id
	d.setSocket(path)
	d.update(Serving, "", time.Time{})
	d.log.Debug("registration socket published", "socket", path, "endpoint", d.at.endpoint, "generation", gen)
	return g, nil
}

// checkGuard runs the guard, if any.
func (d *driver) checkGuard() error {
	if d.guard == nil {
		return nil
	}
	return d.guard()
}

// sleepBackoff waits for the backoff interval wait after the failure err (nil: a wait a
// hand-over gave the loop) and reports whether the loop goes on. When something that is not
// ours blocks a registration socket's path (err holds a sockfile.NotSocketError or a
// sockfile.ServedError), the wait also ends once it is gone: ws watches the path.
func (d *driver) sleepBackoff(ctx context.Context, wait time.Duration, err error, ws watches) bool {
	if ns, blocked := errors.AsType[*sockfile.NotSocketError](err); blocked {
		return d.sleepBlocked(ctx, wait, ws.of(ns.Path), ns.Path, func() bool { return pathClear(ns.Path) })
	}
	if se, served := errors.AsType[*sockfile.ServedError](err); served {
		d.setHeldByOther()
		return d.sleepBlocked(ctx, wait, ws.of(se.Path), se.Path, func() bool { return sockfile.CheckNotServed(se.Path, fsid.ID{}) == nil })
	}
	// Whether the driver is on this node is kept up to date meanwhile: a driver removed from
	// the node while it backs off is absent at once, not after the backoff.
	_, ok := sleepUntil(ctx, wait, ws.ep, func(fswatch.Change) bool {
		d.lookPresence()
		return false
	})
	return ok
}

// accepted records that kubelet registered g.
func (d *driver) accepted(ctx context.Context, g *generation) {
	g.registered = true
	d.p.registered()
	d.record(evAccepted)
	d.update(Registered, "", time.Time{})
	// What kubelet has just learnt from the driver, for the comparison after a restart
	// (restart.go). Asked only now: a call before kubelet's own would be one more for the
	// driver to answer, and could take a failure meant for kubelet.
	d.nodeInfo = d.recordNodeInfo(ctx)
}

// failed records a failed attempt, err, and returns the wait before the next one, which the
// status shows.
func (d *driver) failed(err error) time.Duration {
	wait := d.p.wait()
	d.mu.Lock()
	d.st.Failures++
	d.mu.Unlock()
	d.update(BackingOff, err.Error(), time.Now().Add(wait))
	d.log.Warn("registration failed", "err", err, "retryIn", wait.Round(time.Millisecond))
	return wait
}

// sleepBlocked waits for wait to pass or, watching a registration socket's path through sock,
// for the path to be clear (clear) of what blocked the socket: something multireg never
// removes. It reports false when ctx ends first.
func (d *driver) sleepBlocked(ctx context.Context, wait time.Duration, sock *fswatch.Subscription, path string, clear func() bool) bool {
	sock.Take() // what happened before this look is seen by it
	if clear() {
		return true
	}
	woken, ok := sleepUntil(ctx, wait, sock, func(fswatch.Change) bool { return clear() })
	if woken {
		d.log.Info("registration socket path is clear; publishing the socket", "socket", path)
	}
	return ok
}

// pathClear reports whether nothing but a socket, or nothing, is at a socket's path.
func pathClear(path string) bool {
	_, err := sockfile.CheckSocketOrMissing(path)
	_, blocked := errors.AsType[*sockfile.NotSocketError](err)
	return !blocked
}

// sleepUntil waits for wait to pass, or for a wake-up of s (none when nil) after which ready
// holds for what s reports (woken). It reports false when ctx ends first.
func sleepUntil(ctx context.Context, wait time.Duration, s *fswatch.Subscription, ready func(fswatch.Change) bool) (woken, ok bool) {
	t := time.NewTimer(wait)
	defer t.Stop()
	var wake <-chan struct{}
	if s != nil {
		wake = s.C()
	}
	for {
		select {
		case <-ctx.Done():
			return false, false
		case <-t.C:
			return false, true
		case <-wake:
			if ready(s.Take()) {
				return true, true
			}
		}
	}
}
