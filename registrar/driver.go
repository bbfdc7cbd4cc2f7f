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

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/fswatch"
	"multireg.dev/multireg/internal/handover"
	"multireg.dev/multireg/internal/regdir"
	"multireg.dev/multireg/internal/regserver"
	"multireg.dev/multireg/internal/sockfile"
)

// Why a loop's context ends, as its cause.
var (
	// errRemoved: the driver left the configuration; its socket is removed.
	errRemoved = errors.New("driver removed from the configuration")
	// errShutdown: the process stops; sockets stay unless cleanup was asked for.
	errShutdown = errors.New("shutting down")
	// errHandOff: the loop's sockets and state go to another instance (internal/handover); the
	// sockets stay, listening, and the loop keeps a copy of each (detach).
	errHandOff = errors.New("handing over to another instance")
)

// driver is one driver's registration loop. It owns its socket generations and every
// failure: nothing it does blocks another driver.
type driver struct {
	spec    config.Driver
	log     *slog.Logger
	w       *fswatch.Watcher
	probe   func(context.Context, config.Driver) error
	cleanup bool // remove the socket on shutdown too
	// guard, if set, must pass before a socket is published: the process still holds the
	// registration directory.
	guard func() error
	// slots bound the calls to endpoints in flight across the supervisor's loops.
	slots probeSlots
	// hub serves the loop's sockets, with the supervisor's other loops'.
	hub *regserver.Hub
	// kubelet is what the supervisor's loops know of the kubelet that registers them.
	kubelet *kubeletClient

	verdictC chan struct{} // capacity 1: a verdict is pending

	// Only the loop's goroutine uses these.
	// at is the endpoint registered, or to register (pattern.go); zero for a pattern not yet
	// matched.
	at target
	// nodeInfo is what a CSI driver answered NodeGetInfo once kubelet registered the current
	// socket (restart.go); nil when not asked or not answered.
	nodeInfo *csi.NodeGetInfoResponse
	// health are the DRAResourceHealth services the driver's endpoint serves, advertised after
	// its versions (health.go); nil when none, or not asked.
	health []string
	// healthOf is the endpoint socket health was asked of (or a hand-over told of).
	healthOf fsid.ID
	// prev is the generation a handover leaves registered, until its successor is registered
	// and prev's endpoint is gone (pattern.go).
	prev *generation
	// p paces registration attempts.
	p *pacing
	// probed is the endpoint's socket as last probed ready; zero when it was not there.
	probed fsid.ID
	// adopted is what a hand-over gave the loop to go on from (inherit.go); the loop takes it
	// when it starts. handed is what the loop hands over when it stops for one (detach).
	adopted *adoption
	handed  *handover.Driver

	mu      sync.Mutex
	gen     uint64             // the current socket generation; verdicts for others are dropped
	pending *regserver.Verdict // the latest verdict for gen
	st      DriverStatus
}

func newDriver(spec config.Driver, log *slog.Logger, w *fswatch.Watcher, cleanup bool) *driver {
	d := &driver{
		spec:     spec,
		log:      log.With("driver", spec.Name),
		w:        w,
		probe:    probeEndpoint,
		cleanup:  cleanup,
		verdictC: make(chan struct{}, 1),
		p:        newPacing(spec),
	}
	if !spec.EndpointIsPattern() {
		d.at = fixedTarget(spec)
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
	endEndpointMoved                   // another socket matching the endpoint pattern takes over
)

// run is the loop: wait for the endpoint, publish a socket, wait for kubelet's verdict or an
// event, and on failure back off and start again, until ctx ends. It returns only when
// everything it started has stopped.
//
// Its state is a loop, on the heap, and each step is a call that returns before the next: the
// loop spends most of its life in await, and the runtime shrinks an idle goroutine's stack to
// what it holds there. With every step's locals on it, each of 1000 drivers would hold 8 KiB
// or more instead of 4.
func (d *driver) run(ctx context.Context) {
	if err := selfRegistered(d.spec); err != nil {
		d.stayRefused(ctx, err)
		return
	}
	l := d.newLoop(ctx)
	defer l.end()
	if !l.begin() {
		return
	}
	for l.prepare() {
		end, err := d.await(ctx, l.cur, l.kept, l.ws)
		if !l.after(end, err) {
			return
		}
	}
}

// loop is the state of a driver's loop between its steps.
type loop struct {
	d   *driver
	ctx context.Context
	// Two curves of the same policy: waiting for the endpoint (probeB), reset when it answers,
	// and registering (d.p), reset when kubelet accepts. A long outage of the endpoint must not
	// make the first registration failure after it wait the longest interval.
	probeB *backoff.ExponentialBackOff
	ws     watches
	a      *adoption // what a hand-over gave the loop, until the endpoint answers

	// cur is the socket this loop serves: one it published, or one a hand-over gave it.
	cur *generation
	// restarted: the endpoint of a driver whose cur is registered was created anew, and its
	// type may keep the registration (restart.go); once it answers, keepsRegistration decides.
	restarted bool
	// resume: a handover's new instance went before kubelet registered it; cur is again the
	// generation kubelet holds, and is kept if its endpoint is still the one to register.
	// Also a registered socket a hand-over gave the loop.
	resume bool
	// pending: a socket a hand-over gave the loop awaits kubelet's verdict: the loop waits for
	// it, with the registration timeout, rather than publish another.
	pending bool
	// kept: cur is registered already (kept rather than published); await gives it no timeout.
	kept bool
}

func (d *driver) newLoop(ctx context.Context) *loop {
	l := &loop{d: d, ctx: ctx, probeB: newBackoff(d.spec.Backoff), ws: d.subscribe(), a: d.adopted}
	d.adopted = nil
	if l.a != nil {
		l.cur = l.a.cur
	}
	return l
}

// end stops what the loop started (shutdown), then its watches.
func (l *loop) end() {
	l.d.shutdown(context.Cause(l.ctx), l.cur)
	l.ws.close()
}

// begin waits, for a backing-off driver a hand-over gave the loop, until the next attempt the
// other instance had planned. It reports false when the loop ends first.
func (l *loop) begin() bool {
	a := l.a
	return a == nil || a.resumeAt.IsZero() || l.d.sleepUntilResume(l.ctx, a.resumeAt, l.ws)
}

// prepare waits for the endpoint, then keeps cur or publishes a new generation, backing off
// while publishing fails. It reports false when the loop ends.
func (l *loop) prepare() bool {
	d, ctx := l.d, l.ctx
	for {
		epID, err := d.readyEndpoint(ctx, l.probeB, l.ws.ep, l.cur)
		if _, mismatch := errors.AsType[*nameMismatchError](err); mismatch {
			// The driver restarted under another name: kubelet must not keep it.
			if l.restarted {
				d.reregister()
				l.restarted = false
			}
			d.log.Warn("driver reports another name; its registration is withdrawn", "err", err)
			d.retire(l.cur)
			l.cur = nil
			epID, err = d.readyEndpoint(ctx, l.probeB, l.ws.ep, nil)
		}
		if err != nil {
			return false // ctx ended
		}
		d.probed = epID
		if l.a != nil {
			l.resume, l.restarted, l.pending = d.adoptFlags(l.a, l.cur, epID)
			l.a = nil
		}

		if l.cur == nil && d.prev != nil && d.prev.at == d.at {
			// The new instance's attempt failed and it went: the old one is the one to register,
			// and kubelet holds it already (a second socket for it would be refused).
			l.cur, l.resume = d.resume(), true
		}
		if l.resume && l.cur.at != d.at && d.prev == nil {
			d.prev, l.cur = l.cur, nil // a newer instance answers: hand over to it
		}
		cur := l.cur
		kept := cur != nil && cur.at == d.at && (l.resume || l.restarted && d.keepsRegistration(ctx, cur))
		awaiting := !kept && l.pending && cur != nil && cur.at == d.at
		l.restarted, l.resume, l.pending = false, false, false
		if ctx.Err() != nil {
			return false // a look cut short by the end (a hand-over) decides nothing
		}
		switch {
		case kept:
			d.update(Registered, "", time.Time{}) // the wait for the endpoint may have said otherwise
		case awaiting:
			d.update(Serving, "", time.Time{})
		default:
			d.nodeInfo = nil // asked again once kubelet has registered the new socket
			g, err := d.publish(d.slot(cur), cur)
			if err != nil {
				d.record(endPublishFailed)
				if !d.backOff(ctx, fmt.Errorf("publish socket: %w", err), l.ws) {
					return false
				}
				continue
			}
			if cur != nil {
				cur.stop() // its file was just replaced by g's
			}
			l.cur = g
		}
		l.kept = kept
		return true
	}
}

// after acts on how await ended. It reports false when the loop ends.
func (l *loop) after(end ending, err error) bool {
	d, ctx := l.d, l.ctx
	if ctx.Err() != nil {
		end = endStopped // a look cut short by the end decides nothing
	}
	if end != endEndpointRestarted && end != endEndpointMoved {
		d.record(end)
	}
	cur := l.cur
	switch end {
	case endStopped:
		return false
	case endRejected, endTimeout:
		d.retire(cur)
		l.cur = nil
		if !d.backOff(ctx, err, l.ws) {
			return false
		}
	case endSocketRemoved:
		// Recreate at once: the socket was removed or replaced by someone else.
		cur.stop()
		l.cur = nil
		d.log.Info("registration socket removed or replaced; recreating it", "socket", d.spec.SocketPath)
	case endEndpointRestarted:
		// Keep serving the old socket while the driver comes up again; a new socket, if
		// the driver needs one, is renamed over it.
		if l.restarted = d.keepsOnRestart(cur); !l.restarted {
			d.reregister()
		}
	case endEndpointMoved:
		switch {
		case !d.handover():
			d.reregister("why", "the endpoint moved")
		case d.prev != nil && (!cur.registered || d.gone(ctx, cur.at)):
			// The instance being registered went, or a newer one came, before kubelet
			// registered it; or the new instance went while the old one runs: go back to the
			// old registration, which kubelet holds and whose instance answers.
			d.retire(cur)
			l.cur = d.resume()
			l.resume = true
		case cur.registered:
			// kubelet holds cur: the registration stays with it until the new instance's is
			// made. An older one still kept is no longer needed.
			if d.prev != nil {
				d.retire(d.prev)
			}
			d.prev, l.cur = cur, nil
			d.log.Info("driver endpoint moved; registering the new instance beside the old one")
		default:
			d.reregister("why", "the endpoint moved")
		}
	}
	return true
}

// await serves generation g until something ends it, and says why: kubelet rejected it or no
// verdict came within the timeout in force (both with an error that says so), the socket was
// removed or replaced, or the endpoint, probed as d.probed, restarted or (a pattern) moved. It
// returns endStopped when ctx ends. A generation kubelet has already registered (registered)
// has no timeout. The loop waits here most of its life: its state is a waiting, on the heap,
// and the work of each wake-up is done in calls that return (see run).
func (d *driver) await(ctx context.Context, g *generation, registered bool, ws watches) (ending, error) {
	w := d.newWaiting(ctx, g, registered)
	defer w.stop()
	var altC <-chan struct{}
	if ws.alt != nil {
		altC = ws.alt.C()
	}
	if end := w.look(0); end != endStopped { // a first look: is the endpoint up?
		return end, nil
	}
	for {
		select {
		case <-ctx.Done():
			return endStopped, nil
		case <-d.verdictC:
			if err := w.verdict(); err != nil {
				return endRejected, err
			}
			if w.moveOnVerdict && g.registered {
				w.moveOnVerdict = false
				if end := w.look(0); end != endStopped {
					return end, nil
				}
			}
		case <-w.timeoutC:
			return endTimeout, w.timedOut()
		case <-ws.sock.C():
			if d.socketsGone(ws.sock.Take(), g) {
				return endSocketRemoved, nil
			}
		case <-altC:
			if d.socketsGone(ws.alt.Take(), g) {
				return endSocketRemoved, nil
			}
		case <-w.recheck.C:
			if end := w.look(0); end != endStopped {
				return end, nil
			}
		case <-ws.ep.C():
			if end := w.look(ws.ep.Take()); end != endStopped {
				return end, nil
			}
		}
	}
}

// waiting is the state of an await.
type waiting struct {
	d        *driver
	ctx      context.Context
	g        *generation
	timeout  *time.Timer      // nil without a registration timeout
	timeoutC <-chan time.Time // nil once kubelet registered g, or without a timeout
	// Another socket matching the endpoint pattern is looked at again, sooner at first: it
	// may not answer yet, or the target may stop answering without its file going.
	recheck   *time.Timer
	recheckIn time.Duration
	// The endpoint's socket as this wait knows it; d.probed stays the one the registration
	// was made or kept with until the loop probes the endpoint again, so that a hand-over in
	// between tells the next instance of a restart.
	epID fsid.ID
	// moveOnVerdict: a newer instance answered while kubelet was registering g; the pattern
	// is looked at again once the verdict is in (see look).
	moveOnVerdict bool
}

func (d *driver) newWaiting(ctx context.Context, g *generation, registered bool) *waiting {
	w := &waiting{d: d, ctx: ctx, g: g, recheck: time.NewTimer(time.Hour), epID: d.probed}
	w.recheck.Stop()
	if d.p.timeout > 0 && !registered {
		w.timeout = time.NewTimer(d.p.timeout)
		w.timeoutC = w.timeout.C
	}
	return w
}

func (w *waiting) stop() {
	w.recheck.Stop()
	if w.timeout != nil {
		w.timeout.Stop()
	}
}

// look looks at the endpoint after a wake-up (ev; 0: none) and says whether it ends the wait
// (endStopped: it does not).
func (w *waiting) look(ev fswatch.Change) ending {
	d, g := w.d, w.g
	if d.spec.EndpointIsPattern() {
		to, others := d.moved(w.ctx)
		switch {
		case to == "":
		case d.handover() && !g.registered && g.awaiting():
			// kubelet asked g's GetInfo and its verdict is on its way: it may hold g's
			// registration already. Moving now would withdraw it; the new instance is
			// registered beside it once the verdict is in (await looks again then).
			if !w.moveOnVerdict {
				d.log.Info("a newer instance answers; it is registered beside this one once kubelet's verdict on this one is in",
					"endpoint", d.at.local, "newer", to)
			}
			w.moveOnVerdict = true
		default:
			d.log.Info("driver endpoint moved", "from", d.at.local, "to", to)
			return endEndpointMoved
		}
		if d.prev != nil && g.registered {
			d.settleHandover(w.ctx, g)
			others = others || d.prev != nil
		}
		w.recheckIn = nextRecheck(w.recheckIn, ev != 0, others)
		if w.recheckIn > 0 {
			w.recheck.Reset(w.recheckIn)
		}
	}
	if d.endpointRestarted(ev, &w.epID) {
		return endEndpointRestarted
	}
	return endStopped
}

// verdict takes kubelet's verdict, if one is pending: a rejection ends the wait, with the
// error to report; an acceptance lifts the timeout.
func (w *waiting) verdict() error {
	switch v := w.d.takeVerdict(); {
	case v == nil:
	case !v.Registered:
		return v.Rejection()
	default:
		w.timeoutC = nil
		w.d.accepted(w.ctx, w.g)
		w.d.settleHandover(w.ctx, w.g)
	}
	return nil
}

// timedOut is the error of a wait whose registration timeout passed.
func (w *waiting) timedOut() error {
	p := w.d.p
	allowed := p.timeout
	return fmt.Errorf("no registration verdict from kubelet within %s; the next attempt allows %s", allowed, p.timedOut())
}

// socketGone looks at g's socket after a wake-up (ev) and reports whether another file, or
// none, is at its path.
func (d *driver) socketGone(ev fswatch.Change, g *generation) bool {
	if ev&fswatch.DirGone != 0 {
		d.log.Warn("registration directory removed or moved", "dir", filepath.Dir(g.path))
	}
	id, _, err := fsid.Stat(g.path)
	return err != nil || id != g.id
}

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
	for _, g := range []*generation{d.prev, cur} {
		switch {
		case g == nil:
		case remove:
			d.retire(g)
		default:
			g.stop()
		}
	}
	d.prev = nil
	if !remove {
		return
	}
	// A socket left by an earlier run of multireg that this run never replaced.
	for _, path := range []string{d.spec.SocketPath, d.spec.AltSocketPath} {
		if path == "" {
			continue
		}
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
	g.stop()
	if _, err := sockfile.RemoveIfOurs(g.path, g.id); err != nil {
		d.log.Warn("remove registration socket", "socket", g.path, "err", err)
	}
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
	d.gen++
	gen := d.gen
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
	var g *generation
	if err == nil {
		// Served before it is renamed onto path: a failure to serve must not replace cur.
		_, id, err = sockfile.Publish(path, func(l *net.UnixListener) (func(), error) {
			var err error
			g, err = d.serveOn(l, path, fsid.ID{}, gen, d.at, d.versions(), false)
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

// notify takes kubelet's verdict from a registration server. It never blocks.
func (d *driver) notify(v regserver.Verdict) {
	d.mu.Lock()
	if v.Gen != d.gen {
		d.mu.Unlock()
		d.log.Debug("verdict for an older socket ignored", "generation", v.Gen, "registered", v.Registered)
		return
	}
	d.pending = &v
	d.mu.Unlock()
	select {
	case d.verdictC <- struct{}{}:
	default:
	}
}

func (d *driver) takeVerdict() *regserver.Verdict {
	d.mu.Lock()
	defer d.mu.Unlock()
	v := d.pending
	d.pending = nil
	return v
}

// backOff records a failure, waits for the next backoff interval and reports whether the
// loop goes on. When something that is not ours blocks a registration socket's path (err holds
// a sockfile.NotSocketError or a sockfile.ServedError), the wait also ends once it is gone: ws
// watches the path.
func (d *driver) backOff(ctx context.Context, err error, ws watches) bool {
	wait := d.failed(err)
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
	d.record(endRegistered)
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
