package registrar

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"maps"
	"net"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/cenkalti/backoff/v4"
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

// dirPollInterval paces the look at files whose directory inotify refuses to watch (its watch
// limit). It only runs in that state.
const dirPollInterval = time.Second

// Probes after the endpoint's socket appears: 50ms, 100ms, … 1.6s, then the backoff.
const (
	quickProbeMin = 50 * time.Millisecond
	quickProbeMax = 1600 * time.Millisecond
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
		Since:       time.Now(),
		Results:     map[string]int{},
		Recreations: map[string]int{},
	}
	if !spec.WaitForEndpoint {
		d.st.Phase = Serving
	}
	return d
}

// status returns a snapshot of the loop's state.
func (d *driver) status() DriverStatus {
	d.mu.Lock()
	defer d.mu.Unlock()
	st := d.st
	st.Results = maps.Clone(d.st.Results)
	st.Recreations = maps.Clone(d.st.Recreations)
	return st
}

// count records how an attempt ended, and for a failure why the socket is recreated.
func (d *driver) count(result, recreation string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if result != "" {
		d.st.Results[result]++
	}
	if recreation != "" {
		d.st.Recreations[recreation]++
	}
}

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

	for {
		var epID fileID
		if d.spec.WaitForEndpoint {
			id, err := d.waitEndpoint(ctx, probeB, ep, cur != nil)
			if _, mismatch := errors.AsType[*nameMismatchError](err); mismatch {
				// The driver restarted under another name: kubelet must not keep it.
				d.log.Warn("driver reports another name; its registration is withdrawn", "err", err)
				d.retire(cur)
				cur = nil
				id, err = d.waitEndpoint(ctx, probeB, ep, false)
			}
			if err != nil {
				return // ctx ended
			}
			epID = id
		} else {
			epID, _, _ = statID(d.spec.LocalEndpoint)
		}

		g, err := d.publish()
		if err != nil {
			d.count(ResultPublishFailed, "")
			if !d.backOff(ctx, p.backoff, fmt.Errorf("publish socket: %w", err), sock) {
				return
			}
			continue
		}
		if cur != nil {
			cur.stop() // its file was just replaced by g's
		}
		cur = g

		reason, msg := d.await(ctx, p, cur, epID, sock, ep)
		switch reason {
		case "":
			return // ctx ended
		case ReasonRejected, ReasonTimeout:
			result := ResultRejected
			if reason == ReasonTimeout {
				result = ResultTimeout
				msg += fmt.Sprintf("; the next attempt allows %s", p.timedOut())
			}
			d.count(result, reason)
			d.retire(cur)
			cur = nil
			if !d.backOff(ctx, p.backoff, errors.New(msg), sock) {
				return
			}
		case ReasonSocketRemoved:
			// Recreate at once: the socket was removed or replaced by someone else.
			cur.stop()
			cur = nil
			d.count("", reason)
			d.log.Info("registration socket removed or replaced; recreating it", "socket", d.spec.SocketPath)
		case ReasonEndpointRestarted:
			// Keep serving the old socket while the driver comes up again; the new socket
			// is renamed over it.
			d.count("", reason)
			d.log.Info("driver endpoint restarted; registering again", "endpoint", d.spec.LocalEndpoint)
		}
	}
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

// waitEndpoint probes the endpoint until it is ready, backing off between probes and
// probing again at once when the endpoint's socket is created. It returns the endpoint's
// identity. It fails only when ctx ends or, while an older socket still serves
// (serving), when the CSI driver reports another name: that socket must go first.
func (d *driver) waitEndpoint(ctx context.Context, b *backoff.ExponentialBackOff, ep *subscription, serving bool) (fileID, error) {
	lastErr := ""
	// After the endpoint's socket is created, a driver may still be between bind and listen,
	// or registering its services: probe again soon, a few times, before the backoff resumes.
	var quick time.Duration
	var quickFor fileID // the endpoint socket a quick series was started for
	for {
		_, _ = ep.rewatch() // best effort: the endpoint's directory may not exist yet
		ep.take()
		id, _, statErr := statID(d.spec.LocalEndpoint)
		err := d.probe(ctx, d.spec)
		if ctx.Err() != nil {
			return fileID{}, ctx.Err()
		}
		if err == nil {
			if statErr != nil {
				id = fileID{}
			}
			d.setEndpointUp(true)
			b.Reset()
			return id, nil
		}
		_, mismatch := errors.AsType[*nameMismatchError](err)
		d.setEndpointUp(mismatch) // a driver that answers under another name is up
		if statErr == nil && id != quickFor {
			// A socket not seen before that does not answer yet: the driver may be between
			// bind and listen (its Create event may have come before our watch).
			quickFor, quick = id, quickProbeMin
		}
		var wait time.Duration
		if quick > 0 && quick <= quickProbeMax {
			wait, quick = quick, quick*2
		} else {
			wait = next(b)
		}
		d.update(WaitingForEndpoint, err.Error(), time.Now().Add(wait))
		if mismatch && serving {
			return fileID{}, err
		}
		// Each distinct reason is a warning once; its repetitions are debug.
		if msg := err.Error(); msg != lastErr {
			lastErr = msg
			d.log.Warn("endpoint not ready", "err", err, "retryIn", wait.Round(time.Millisecond))
		} else {
			d.log.Debug("endpoint not ready", "err", err, "retryIn", wait.Round(time.Millisecond))
		}
		woken, ok := d.sleep(ctx, wait, ep)
		if !ok {
			return fileID{}, ctx.Err()
		}
		if woken {
			quick = quickProbeMin
		}
	}
}

// sleep waits for wait to pass or, with a subscription, for the endpoint's socket to be
// created (woken). While the endpoint's directory does not exist, its nearest existing
// ancestor is watched instead, and the creation of the next directory on the way wakes the
// loop too. It reports false when ctx ends first.
func (d *driver) sleep(ctx context.Context, wait time.Duration, ep *subscription) (woken, ok bool) {
	var wake, dirWake <-chan struct{}
	var anc *subscription
	if ep != nil {
		wake = ep.c
		renewed, err := ep.rewatch()
		if renewed {
			// Events before this watch are lost: the socket may have appeared since the probe.
			if _, err := os.Lstat(d.spec.LocalEndpoint); err == nil {
				return true, true
			}
		}
		if err != nil {
			a, appeared, err := ep.ancestor()
			switch {
			case appeared:
				return true, true
			case err != nil:
				d.log.Debug("cannot watch for the endpoint's directory; the backoff paces the probes", "err", err)
			default:
				anc, dirWake = a, a.c
				defer anc.close()
			}
		}
	}
	return sleepUntil(ctx, wait,
		wakeUp{wake, func() bool { return ep.take()&evCreate != 0 }},
		// A directory on the way appeared (or the watch was lost): look.
		wakeUp{dirWake, func() bool { return anc.take()&(evCreate|evResync|evDirGone) != 0 }})
}

// wakeUp ends a sleep early: a kick on c after which ready reports true. A nil c never kicks.
type wakeUp struct {
	c     <-chan struct{}
	ready func() bool
}

// sleepUntil waits for wait to pass or for a wake-up (woken). It reports false when ctx ends
// first.
func sleepUntil(ctx context.Context, wait time.Duration, a, b wakeUp) (woken, ok bool) {
	t := time.NewTimer(wait)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return false, false
		case <-t.C:
			return false, true
		case <-a.c:
			if a.ready() {
				return true, true
			}
		case <-b.c:
			if b.ready() {
				return true, true
			}
		}
	}
}

// sleepBlocked waits for wait to pass or, watching the socket's path through sock, for the
// path to be clear of what blocked the socket: something that is not a socket, which
// multireg never removes. It reports false when ctx ends first.
func (d *driver) sleepBlocked(ctx context.Context, wait time.Duration, sock *subscription) bool {
	if _, err := sock.rewatch(); err != nil {
		d.log.Debug("cannot watch the registration socket's path; the backoff paces the retries", "err", err)
	}
	sock.take() // what happened before this look is seen by it
	if d.socketPathClear() {
		return true
	}
	woken, ok := sleepUntil(ctx, wait, wakeUp{sock.c, func() bool {
		sock.take()
		return d.socketPathClear()
	}}, wakeUp{})
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

// await serves generation g until something ends it, and says why: kubelet rejected it, no
// verdict came within the timeout in force, the socket was removed or replaced, or the
// endpoint restarted. It returns "" when ctx ends.
func (d *driver) await(ctx context.Context, p *pacing, g *generation, epID fileID, sock, ep *subscription) (reason, msg string) {
	var timeout <-chan time.Time
	if t := p.timeout; t > 0 {
		timer := time.NewTimer(t)
		defer timer.Stop()
		timeout = timer.C
	}
	// A directory that does not exist cannot be watched: the endpoint's nearest existing
	// ancestor is watched for it instead. Where inotify refuses (its watch limit), the files
	// are looked at once a second.
	var poll <-chan time.Time
	var pollTicker *time.Ticker
	var anc *subscription // the endpoint directory's ancestor, while the directory is missing
	var ancC <-chan struct{}
	defer func() {
		if pollTicker != nil {
			pollTicker.Stop()
		}
		if anc != nil {
			anc.close()
		}
	}()
	startPoll := func() {
		if poll == nil {
			pollTicker = time.NewTicker(dirPollInterval)
			poll = pollTicker.C
		}
	}
	watch := func(s *subscription) {
		renewed, err := s.rewatch()
		switch {
		case err == nil:
			if renewed {
				s.kick(evResync) // events before the watch are lost: look now
			}
			if s == ep && anc != nil {
				anc.close()
				anc, ancC = nil, nil
			}
		case s == sock && errors.Is(err, fs.ErrNotExist):
			s.kick(evDirGone) // the registration directory is gone, and the socket with it
		case s == ep && errors.Is(err, fs.ErrNotExist):
			if anc != nil {
				return
			}
			a, appeared, aerr := ep.ancestor()
			switch {
			case appeared:
				ep.kick(evResync) // look again at once
			case aerr != nil:
				startPoll()
			default:
				anc, ancC = a, a.c
			}
		default:
			startPoll()
		}
	}
	watch(sock)
	watch(ep)

	// checkEndpoint looks at the endpoint's socket and reports whether the driver restarted:
	// its socket was created anew (created), or, when events may have been lost, it is no
	// longer the file that was probed. A change of attributes (a chmod) is no restart.
	checkEndpoint := func(created, eventsLost bool) bool {
		id, _, err := statID(d.spec.LocalEndpoint)
		if err != nil {
			if d.setEndpointUp(false) {
				d.log.Warn("driver endpoint is gone; the registration stays until it comes back", "endpoint", d.spec.LocalEndpoint)
			}
			return false
		}
		d.setEndpointUp(true)
		if epID == (fileID{}) {
			epID = id // not there when the socket was published (waitForEndpoint: false)
			return false
		}
		return (created || eventsLost) && id != epID
	}
	checkEndpoint(false, false)

	for {
		select {
		case <-ctx.Done():
			return "", ""
		case <-d.verdictC:
			v := d.takeVerdict()
			if v == nil {
				continue
			}
			if !v.registered {
				return ReasonRejected, "kubelet rejected the registration: " + v.msg
			}
			timeout = nil
			p.registered()
			d.count(ResultRegistered, "")
			d.update(Registered, "", time.Time{})
		case <-timeout:
			return ReasonTimeout, fmt.Sprintf("no registration verdict from kubelet within %s", p.timeout)
		case <-sock.c:
			if sock.take()&evDirGone != 0 {
				d.log.Warn("registration directory removed or moved", "dir", sock.dir)
				watch(sock) // a directory moved back keeps our socket: watch it again
			}
			if id, _, err := statID(g.path); err != nil || id != g.id {
				return ReasonSocketRemoved, ""
			}
		case <-ep.c:
			ev := ep.take()
			if ev&evDirGone != 0 {
				watch(ep)
			}
			if checkEndpoint(ev&evCreate != 0, ev&(evDirGone|evResync) != 0) {
				return ReasonEndpointRestarted, ""
			}
		case <-ancC:
			anc.take()
			// A directory on the way to the endpoint appeared: watch deeper, or the
			// endpoint's directory itself.
			anc.close()
			anc, ancC = nil, nil
			watch(ep)
			ep.kick(evResync)
		case <-poll:
			if sock.watching() && ep.watching() {
				pollTicker.Stop()
				poll, pollTicker = nil, nil
			}
			if !sock.watching() {
				watch(sock)
				sock.kick(evResync)
			}
			if !ep.watching() {
				watch(ep)
				ep.kick(evResync)
			}
		}
	}
}

// backOff records a failure, waits for the next backoff interval and reports whether the
// loop goes on. When something that is not a socket blocks the socket's path (err holds a
// notSocketError), the wait also ends once it is gone: sock watches the path.
func (d *driver) backOff(ctx context.Context, b *backoff.ExponentialBackOff, err error, sock *subscription) bool {
	wait := next(b)
	d.mu.Lock()
	d.st.Failures++
	d.mu.Unlock()
	d.update(BackingOff, err.Error(), time.Now().Add(wait))
	d.log.Warn("registration failed", "err", err, "retryIn", wait.Round(time.Millisecond))
	if _, blocked := errors.AsType[*notSocketError](err); blocked {
		return d.sleepBlocked(ctx, wait, sock)
	}
	_, ok := d.sleep(ctx, wait, nil)
	return ok
}

// update sets the phase, the last error and the next attempt, and logs a phase change.
func (d *driver) update(p Phase, lastErr string, nextAttempt time.Time) {
	d.mu.Lock()
	changed := d.st.Phase != p
	if changed {
		d.st.Phase = p
		d.st.Since = time.Now()
	}
	if lastErr != "" || p == Registered {
		d.st.LastError = lastErr
	}
	d.st.NextAttempt = nextAttempt
	d.mu.Unlock()
	if changed {
		d.log.Info("phase changed", "phase", p) // the reason is logged where it arises
	}
}

// setEndpointUp records the endpoint's state and reports whether it changed.
func (d *driver) setEndpointUp(up bool) bool {
	d.mu.Lock()
	changed := d.st.EndpointUp != up
	d.st.EndpointUp = up
	d.mu.Unlock()
	return changed
}

// removeStale removes a socket at path that nothing listens on: one left by an earlier run.
// A live socket (another registrar's) and anything that is not a socket stay.
func removeStale(path string) error {
	if exists, err := checkSocketOrMissing(path); !exists || err != nil {
		var ns *notSocketError
		if errors.As(err, &ns) {
			return nil
		}
		return err
	}
	c, err := net.DialTimeout("unix", path, time.Second)
	if err == nil {
		c.Close()
		return nil // someone serves it
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		return nil
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}
