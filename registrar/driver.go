package registrar

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"path/filepath"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"
	csi "github.com/container-storage-interface/spec/lib/go/csi"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"multireg.dev/multireg/config"
)

// Why a loop's context ends, as its cause.
var (
	// errRemoved: the driver left the configuration; its socket is removed.
	errRemoved = errors.New("driver removed from the configuration")
	// errShutdown: the process stops; sockets stay unless cleanup was asked for.
	errShutdown = errors.New("shutting down")
)

// driver is one driver's registration loop. It owns its socket generations and every
// failure: nothing it does blocks another driver.
type driver struct {
	spec    config.Driver
	log     *slog.Logger
	w       *watcher
	probe   func(context.Context, config.Driver) error
	cleanup bool // remove the socket on shutdown too
	// guard, if set, must pass before a socket is published: the process still holds the
	// registration directory.
	guard func() error

	verdictC chan struct{} // capacity 1: a verdict is pending
	// nodeInfo is what a CSI driver answered NodeGetInfo once kubelet registered the current
	// socket (restart.go); nil when not asked or not answered. Only the loop's goroutine uses it.
	nodeInfo *csi.NodeGetInfoResponse

	mu      sync.Mutex
	gen     uint64   // the current socket generation; verdicts for others are dropped
	pending *verdict // the latest verdict for gen
	st      DriverStatus
}

func newDriver(spec config.Driver, log *slog.Logger, w *watcher, cleanup bool) *driver {
	d := &driver{
		spec:     spec,
		log:      log.With("driver", spec.Name),
		w:        w,
		probe:    probeEndpoint,
		cleanup:  cleanup,
		verdictC: make(chan struct{}, 1),
	}
	d.st = DriverStatus{
		Name:        spec.Name,
		Type:        spec.Type,
		Phase:       WaitingForEndpoint,
		Socket:      spec.SocketPath,
		Endpoint:    spec.Endpoint,
		Required:    spec.Required,
		Since:       time.Now(),
		Results:     map[string]int{},
		Recreations: map[string]int{},
	}
	if !spec.WaitForEndpoint {
		d.st.Phase = Serving
	}
	return d
}

// ending is how a registration attempt, or the socket generation it published, ended. What
// each is counted as in DriverStatus and metrics is status.go's business.
type ending int

const (
	endStopped           ending = iota // the loop's context ended
	endRegistered                      // kubelet accepted the socket; it goes on serving
	endRejected                        // kubelet rejected the registration
	endTimeout                         // no verdict within the registration timeout in force
	endPublishFailed                   // the socket could not be published
	endSocketRemoved                   // someone else removed or replaced the socket
	endEndpointRestarted               // the driver's endpoint socket was created anew
)

// run is the loop: wait for the endpoint, publish a socket, wait for kubelet's verdict or an
// event, and on failure back off and start again, until ctx ends. It returns only when
// everything it started has stopped.
func (d *driver) run(ctx context.Context) {
	// Two curves of the same policy: waiting for the endpoint, reset when it answers, and
	// registering, reset when kubelet accepts. A long outage of the endpoint must not make
	// the first registration failure after it wait the longest interval.
	probeB := newBackoff(d.spec.Backoff)
	p := newPacing(d.spec)
	sock := d.w.subscribe(d.spec.SocketPath)
	defer sock.close()
	ep := d.w.subscribe(d.spec.LocalEndpoint)
	defer ep.close()

	var cur *generation // the socket this loop has published and serves
	defer func() { d.shutdown(context.Cause(ctx), cur) }()
	// restarted: the endpoint of a driver whose cur is registered was created anew, and its
	// type may keep the registration (restart.go); once it answers, keepsRegistration decides.
	restarted := false

	for {
		epID, err := d.readyEndpoint(ctx, probeB, ep, cur != nil)
		if _, mismatch := errors.AsType[*nameMismatchError](err); mismatch {
			// The driver restarted under another name: kubelet must not keep it.
			if restarted {
				d.reregister()
				restarted = false
			}
			d.log.Warn("driver reports another name; its registration is withdrawn", "err", err)
			d.retire(cur)
			cur = nil
			epID, err = d.readyEndpoint(ctx, probeB, ep, false)
		}
		if err != nil {
			return // ctx ended
		}

		kept := restarted && d.keepsRegistration(ctx)
		restarted = false
		if kept {
			d.update(Registered, "", time.Time{}) // the wait for the endpoint may have said otherwise
		} else {
			d.nodeInfo = nil // asked again once kubelet has registered the new socket
			g, err := d.publish()
			if err != nil {
				d.record(endPublishFailed)
				if !d.backOff(ctx, p.backoff, fmt.Errorf("publish socket: %w", err), sock, ep) {
					return
				}
				continue
			}
			if cur != nil {
				cur.stop() // its file was just replaced by g's
			}
			cur = g
		}

		end, err := d.await(ctx, p, cur, kept, epID, sock, ep)
		if end != endEndpointRestarted {
			d.record(end)
		}
		switch end {
		case endStopped:
			return
		case endRejected, endTimeout:
			d.retire(cur)
			cur = nil
			if !d.backOff(ctx, p.backoff, err, sock, ep) {
				return
			}
		case endSocketRemoved:
			// Recreate at once: the socket was removed or replaced by someone else.
			cur.stop()
			cur = nil
			d.log.Info("registration socket removed or replaced; recreating it", "socket", d.spec.SocketPath)
		case endEndpointRestarted:
			// Keep serving the old socket while the driver comes up again; a new socket, if
			// the driver needs one, is renamed over it.
			if restarted = d.keepsOnRestart(); !restarted {
				d.reregister()
			}
		}
	}
}

// await serves generation g until something ends it, and says why: kubelet rejected it or no
// verdict came within the timeout in force (both with an error that says so), the socket was
// removed or replaced, or the endpoint, probed as epID, restarted. It returns endStopped when
// ctx ends. A generation kubelet has already registered (registered) has no timeout.
func (d *driver) await(ctx context.Context, p *pacing, g *generation, registered bool, epID fileID, sock, ep *subscription) (ending, error) {
	var timeout <-chan time.Time
	if p.timeout > 0 && !registered {
		t := time.NewTimer(p.timeout)
		defer t.Stop()
		timeout = t.C
	}
	d.endpointRestarted(0, &epID) // a first look: is the endpoint up?
	for {
		select {
		case <-ctx.Done():
			return endStopped, nil
		case <-d.verdictC:
			switch v := d.takeVerdict(); {
			case v == nil:
			case !v.registered:
				return endRejected, errors.New("kubelet rejected the registration: " + v.msg)
			default:
				timeout = nil
				p.registered()
				d.record(endRegistered)
				d.update(Registered, "", time.Time{})
				// What kubelet has just learnt from the driver, for the comparison after a
				// restart (restart.go). Asked only now: a call before kubelet's own would be one
				// more for the driver to answer, and could take a failure meant for kubelet.
				d.nodeInfo = d.recordNodeInfo(ctx)
			}
		case <-timeout:
			allowed := p.timeout
			return endTimeout, fmt.Errorf("no registration verdict from kubelet within %s; the next attempt allows %s", allowed, p.timedOut())
		case <-sock.c:
			if d.socketGone(sock.take(), g) {
				return endSocketRemoved, nil
			}
		case <-ep.c:
			if d.endpointRestarted(ep.take(), &epID) {
				return endEndpointRestarted, nil
			}
		}
	}
}

// socketGone looks at g's socket after a wake-up (ev) and reports whether another file, or
// none, is at its path.
func (d *driver) socketGone(ev change, g *generation) bool {
	if ev&evDirGone != 0 {
		d.log.Warn("registration directory removed or moved", "dir", filepath.Dir(g.path))
	}
	id, _, err := statID(g.path)
	return err != nil || id != g.id
}

// shutdown stops the current generation when the loop ends. The socket is removed when the
// driver left the configuration, or on shutdown with cleanup; otherwise it stays, so that a
// restarting multireg does not deregister every plugin at once. After the directory was lost
// to another instance nothing is removed: the sockets are that instance's.
func (d *driver) shutdown(cause error, cur *generation) {
	remove := errors.Is(cause, errRemoved) || d.cleanup && !errors.Is(cause, ErrDirLost)
	switch {
	case cur != nil && remove:
		d.retire(cur)
	case cur != nil:
		cur.stop()
	case remove:
		// A socket left by an earlier run of multireg that this run never replaced.
		if err := removeStale(d.spec.SocketPath); err != nil {
			d.log.Warn("remove stale registration socket", "socket", d.spec.SocketPath, "err", err)
		}
	}
	if remove {
		d.log.Info("registration socket removed; kubelet deregisters the plugin", "socket", d.spec.SocketPath)
	}
}

// retire stops a generation and removes its socket, so that kubelet deregisters it.
func (d *driver) retire(g *generation) {
	g.stop()
	if _, err := removeIfOurs(g.path, g.id); err != nil {
		d.log.Warn("remove registration socket", "socket", g.path, "err", err)
	}
}

// publish creates the next socket generation and serves it.
func (d *driver) publish() (*generation, error) {
	// The new generation is current before its socket can be dialled, so that no verdict
	// for it is mistaken for a stale one.
	// The attempt is counted before the socket is visible, so that whoever sees the socket
	// sees the attempt too.
	d.mu.Lock()
	prev := d.gen
	d.gen++
	gen := d.gen
	d.pending = nil
	d.st.Attempts++
	d.mu.Unlock()

	var l *net.UnixListener
	var id fileID
	err := d.checkGuard()
	if err == nil {
		l, id, err = publish(d.spec.SocketPath)
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
	rs := &registrationServer{
		gen: gen,
		info: &registerapi.PluginInfo{
			Type:              d.spec.Type,
			Name:              d.spec.Name,
			Endpoint:          d.spec.Endpoint,
			SupportedVersions: d.spec.SupportedVersions,
		},
		notify: d.notify,
		onInfo: func() { d.log.Debug("kubelet called GetInfo", "generation", gen) },
		onLate: func() {
			d.log.Debug("verdict on a connection that never asked this socket's GetInfo ignored: it is about an older socket", "generation", gen)
		},
	}
	g := serve(l, d.spec.SocketPath, id, rs)
	d.update(Serving, "", time.Time{})
	d.log.Debug("registration socket published", "socket", d.spec.SocketPath, "generation", gen)
	return g, nil
}

// checkGuard runs the guard, if any.
func (d *driver) checkGuard() error {
	if d.guard == nil {
		return nil
	}
	return d.guard()
}

// notify takes kubelet's verdict from a registration server. It never blocks.
func (d *driver) notify(v verdict) {
	d.mu.Lock()
	if v.gen != d.gen {
		d.mu.Unlock()
		d.log.Debug("verdict for an older socket ignored", "generation", v.gen, "registered", v.registered)
		return
	}
	d.pending = &v
	d.mu.Unlock()
	select {
	case d.verdictC <- struct{}{}:
	default:
	}
}

func (d *driver) takeVerdict() *verdict {
	d.mu.Lock()
	defer d.mu.Unlock()
	v := d.pending
	d.pending = nil
	return v
}

// backOff records a failure, waits for the next backoff interval and reports whether the
// loop goes on. When something that is not a socket blocks the socket's path (err holds a
// notSocketError), the wait also ends once it is gone: sock watches the path.
func (d *driver) backOff(ctx context.Context, b *backoff.ExponentialBackOff, err error, sock, ep *subscription) bool {
	wait := next(b)
	d.mu.Lock()
	d.st.Failures++
	d.mu.Unlock()
	d.update(BackingOff, err.Error(), time.Now().Add(wait))
	d.log.Warn("registration failed", "err", err, "retryIn", wait.Round(time.Millisecond))
	if _, blocked := errors.AsType[*notSocketError](err); blocked {
		return d.sleepBlocked(ctx, wait, sock)
	}
	// Whether the driver is on this node is kept up to date meanwhile: a driver removed from
	// the node while it backs off is absent at once, not after the backoff.
	_, ok := sleepUntil(ctx, wait, ep, func(change) bool {
		d.lookPresence()
		return false
	})
	return ok
}

// sleepBlocked waits for wait to pass or, watching the socket's path through sock, for the
// path to be clear of what blocked the socket: something that is not a socket, which
// multireg never removes. It reports false when ctx ends first.
func (d *driver) sleepBlocked(ctx context.Context, wait time.Duration, sock *subscription) bool {
	sock.take() // what happened before this look is seen by it
	if d.socketPathClear() {
		return true
	}
	woken, ok := sleepUntil(ctx, wait, sock, func(change) bool { return d.socketPathClear() })
	if woken {
		d.log.Info("registration socket path is clear; publishing the socket", "socket", d.spec.SocketPath)
	}
	return ok
}

// socketPathClear reports whether nothing but a socket, or nothing, is at the socket's path.
func (d *driver) socketPathClear() bool {
	_, err := checkSocketOrMissing(d.spec.SocketPath)
	_, blocked := errors.AsType[*notSocketError](err)
	return !blocked
}

// sleepUntil waits for wait to pass, or for a wake-up of s (none when nil) after which ready
// holds for what s reports (woken). It reports false when ctx ends first.
func sleepUntil(ctx context.Context, wait time.Duration, s *subscription, ready func(change) bool) (woken, ok bool) {
	t := time.NewTimer(wait)
	defer t.Stop()
	var wake <-chan struct{}
	if s != nil {
		wake = s.c
	}
	for {
		select {
		case <-ctx.Done():
			return false, false
		case <-t.C:
			return false, true
		case <-wake:
			if ready(s.take()) {
				return true, true
			}
		}
	}
}
