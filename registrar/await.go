package registrar

import (
	"context"
	"fmt"
	"path/filepath"
	"time"

	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/fswatch"
)

// How a loop waits on the socket it serves while it awaits kubelet's verdict or serves a
// registration: kubelet's verdict, its timeout, the sockets and the endpoint watched.

// await serves cur until something ends or changes the wait, and returns that event: kubelet's
// verdict (Accepted, Rejected with the error that says so), the registration timeout (only
// while the verdict is awaited), the socket removed or replaced (SocketGone), the endpoint,
// probed as d.probed, gone (EndpointDown), restarted or (a pattern) moved, or kubelet's view
// of a device plugin's move (DevicesDropped). The wait (l.w) lasts as long as the loop waits
// on cur: a step that keeps the loop there (EndpointDown, Accepted) goes on with it. The loop
// waits here most of its life: its state is a waiting, on the heap, and the work of each
// wake-up is done in calls that return (see run).
func (l *loop) await() event {
	for {
		if e := l.awaitNext(); e.kind != evNone {
			return e
		}
		if e, ok := l.woke(l.c.sleep()); ok {
			return e
		}
	}
}

// awaitNext readies the next sleep of the wait on cur (l.c), and returns the event that ends
// the wait before it (None: none does). The first one begins the wait (l.w) with a look at the
// endpoint.
func (l *loop) awaitNext() event {
	d, g, ws := l.d, l.cur, l.ws
	w := l.w
	if w == nil {
		w = d.newWaiting(l.ctx, g, l.st == stRegistered)
		l.w = w
		if k := w.look(0); k != evNone { // a first look: is the endpoint up?
			return event{kind: k}
		}
	}
	if w.moveOnVerdict && g.registered {
		w.moveOnVerdict = false
		if k := w.look(0); k != evNone {
			return event{kind: k}
		}
	}
	// The view's channel is taken before the view is read: a reading in between wakes the
	// sleep.
	l.c = wakeups{view: w.watchView(), done: l.ctx.Done(), verdict: d.verdictC,
		timeout: w.timeoutC, sock: ws.sock.C(), recheck: w.recheck.C, ep: ws.ep.C()}
	if d.checkVerify(g) {
		return event{kind: evDevicesDropped}
	}
	l.c.verify = w.verifyTimer()
	if ws.alt != nil {
		l.c.alt = ws.alt.C()
	}
	if ws.spare != nil {
		l.c.spare = ws.spare.C()
	}
	return event{kind: evNone}
}

// wakeups are what a wait selects on; nil channels never fire.
type wakeups struct {
	view, done, verdict, sock, alt, spare, ep <-chan struct{}
	verify, timeout, recheck                  <-chan time.Time
}

// The wake-ups of a wait, as sleep reports them.
const (
	wakeView = iota
	wakeVerify
	wakeDone
	wakeVerdict
	wakeTimeout
	wakeSock
	wakeAlt
	wakeSpare
	wakeRecheck
	wakeEp
)

// sleep blocks until one of c fires, and says which. A parked loop holds only run's frame and
// this one (run calls it directly): a loop waits here most of its life, and the runtime keeps
// an idle goroutine's stack at no less than four times what it holds. The work of a wake-up
// is woke's, after it returns.
//
//go:noinline
func (c *wakeups) sleep() int {
	select {
	case <-c.view:
		return wakeView
	case <-c.verify:
		return wakeVerify
	case <-c.done:
		return wakeDone
	case <-c.verdict:
		return wakeVerdict
	case <-c.timeout:
		return wakeTimeout
	case <-c.sock:
		return wakeSock
	case <-c.alt:
		return wakeAlt
	case <-c.spare:
		return wakeSpare
	case <-c.recheck:
		return wakeRecheck
	case <-c.ep:
		return wakeEp
	}
}

// woke acts on the wake-up which of a wait on cur, and returns the event that ends the wait,
// if it does.
//
//go:noinline
func (l *loop) woke(which int) (event, bool) {
	d, g, ws, w := l.d, l.cur, l.ws, l.w
	k := evNone
	switch which {
	case wakeView:
		if d.verify != nil && d.verify.until.IsZero() && d.ro != nil && g.registered {
			// kubelet's view changed while the old registration stays: its instance may be
			// gone.
			k = w.look(0)
		}
	case wakeVerify:
	case wakeDone:
		return l.stopped(), true
	case wakeVerdict:
		switch v := d.takeVerdict(g); {
		case v == nil:
		case !v.Registered:
			return event{kind: evRejected, err: v.Rejection()}, true
		default:
			return event{kind: evAccepted}, true
		}
	case wakeTimeout:
		return event{kind: evTimeout}, true
	case wakeSock:
		if d.lookSockets(ws.sock.Take(), g) {
			k = evSocketGone
		}
	case wakeAlt:
		if d.lookSockets(ws.alt.Take(), g) {
			k = evSocketGone
		}
	case wakeSpare:
		if d.lookSockets(ws.spare.Take(), g) {
			k = evSocketGone
		}
	case wakeRecheck:
		k = w.look(0)
	case wakeEp:
		k = w.look(ws.ep.Take())
	}
	return event{kind: k}, k != evNone
}

// waiting is the state of a loop's wait on one generation.
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
	// verifyEnd fires when a device plugin's move has been verified long enough (nil until
	// one is).
	verifyEnd *time.Timer
}

// newWaiting begins a wait on g: with the registration timeout in force unless kubelet has
// registered g already (registered).
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
	if w.verifyEnd != nil {
		w.verifyEnd.Stop()
	}
	if w.timeout != nil {
		w.timeout.Stop()
	}
}

// lift ends the registration timeout: kubelet registered g.
func (w *waiting) lift() {
	w.timeoutC = nil
	if w.timeout != nil {
		w.timeout.Stop()
	}
}

// watchView returns what wakes a wait while a device plugin's move is verified
// (devicemoves.go): kubelet's view changing; nil otherwise. It is taken before the view is
// read, so that a reading in between wakes the next select.
func (w *waiting) watchView() <-chan struct{} {
	if w.d.verify == nil {
		return nil
	}
	return w.d.moves.view.Changed()
}

// verifyTimer returns what fires when a verified move needs a look though the view reads the
// same: the end of the verification, or the moment a drop seen too recently can be decided;
// nil when no move is verified, or while the old registration stays.
func (w *waiting) verifyTimer() <-chan time.Time {
	v := w.d.verify
	if v == nil || v.until.IsZero() {
		return nil
	}
	at := v.until
	if !v.decideAt.IsZero() && v.decideAt.Before(at) {
		at = v.decideAt
	}
	if w.verifyEnd == nil {
		w.verifyEnd = time.NewTimer(time.Until(at))
	} else {
		w.verifyEnd.Reset(time.Until(at))
	}
	return w.verifyEnd.C
}

// look looks at the endpoint after a wake-up (ev; 0: none) and returns the event it sees:
// EndpointMoved, EndpointRestarted, EndpointDown, or None.
func (w *waiting) look(ev fswatch.Change) eventKind {
	d, g := w.d, w.g
	if d.spec.EndpointIsPattern() {
		to, others := d.moved(w.ctx)
		switch {
		case to == "":
		case d.rollsOver() && !g.registered && g.awaiting():
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
			return evEndpointMoved
		}
		if d.ro != nil && g.registered {
			d.settleRollover(w.ctx, g)
			others = others || d.ro != nil
		}
		w.recheckIn = nextRecheck(w.recheckIn, ev != 0, others)
		if w.recheckIn > 0 {
			w.recheck.Reset(w.recheckIn)
		}
	}
	return d.endpointChange(ev, &w.epID)
}

// timedOut grows the registration timeout for the next attempt, and returns the error of the
// attempt whose timeout passed.
func (d *driver) timedOut() error {
	allowed := d.p.timeout
	return fmt.Errorf("no registration verdict from kubelet within %s; the next attempt allows %s", allowed, d.p.timedOut())
}

// socketReplaced looks at g's socket after a wake-up (ev) and reports whether another file, or
// none, is at its path.
func (d *driver) socketReplaced(ev fswatch.Change, g *generation) bool {
	if ev&fswatch.DirGone != 0 {
		d.log.Warn("registration directory removed or moved", "dir", filepath.Dir(g.path))
	}
	id, _, err := fsid.Stat(g.path)
	return err != nil || id != g.id
}
