package registrar

import (
	"time"

	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/fswatch"
)

// How a loop waits on the socket it serves while it awaits kubelet's verdict or serves a
// registration: kubelet's verdict, its timeout, the sockets and the endpoint watched. The wait
// reports what it saw (the events machine.go's waits declare for AwaitingVerdict and
// Registered); what follows is the table's.

// await serves cur until something ends or changes the wait, and returns that event: kubelet's
// verdict (Accepted, Rejected with the error that says so), the registration timeout (only
// while the verdict is awaited), the socket removed or replaced (SocketGone), a rollover's
// previous socket removed (PrevSocketGone) or its old instance gone (OldInstanceGone), the
// endpoint gone (EndpointDown), restarted or (a pattern) moved, or kubelet's view of a device
// plugin's move (DevicesDropped, MoveVerified). The wait (l.w) lasts as long as the loop waits
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
	g, ws := l.cur, l.ws
	w := l.w
	if w == nil {
		w = newWaiting(g, l.ep.probed, l.p.timeout, l.st == stRegistered)
		l.w = w
		if k := l.look(0); k != evNone { // a first look: is the endpoint up?
			return event{kind: k}
		}
	}
	if w.sockAgain {
		// A rollover's previous socket went at the last wake-up: g's own is looked at too.
		w.sockAgain = false
		if l.socks.replaced(w.sockEv, g) {
			return event{kind: evSocketGone}
		}
	}
	if k := w.next; k != evNone {
		// What the look that saw the old instance gone saw of the endpoint besides.
		w.next = evNone
		return event{kind: k}
	}
	if w.moveOnVerdict && g.registered {
		w.moveOnVerdict = false
		if k := l.look(0); k != evNone {
			return event{kind: k}
		}
	}
	// The view's channel is taken before the view is read: a reading in between wakes the
	// sleep.
	l.c = wakeups{view: l.mv.watchView(), done: l.wctx.Done(), verdict: l.d.verdictC,
		timeout: w.timeoutC, sock: ws.sock.C(), recheck: w.recheck.C, ep: ws.ep.C()}
	if k := l.mv.check(l.wctx, g, l.ro != nil, l.st == stRegistered); k != evNone {
		return event{kind: k}
	}
	l.c.verify = l.mv.timer(w)
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
	g, ws := l.cur, l.ws
	k := evNone
	switch which {
	case wakeView:
		if v := l.mv.v; v != nil && v.until.IsZero() && l.ro != nil && g.registered {
			// kubelet's view changed while the old registration stays: its instance may be
			// gone.
			k = l.look(0)
		}
	case wakeVerify:
	case wakeDone:
		return l.interrupted(), true
	case wakeVerdict:
		switch v := l.d.takeVerdict(g); {
		case v == nil:
		case !v.Registered:
			return event{kind: evRejected, err: v.Rejection()}, true
		default:
			return event{kind: evAccepted}, true
		}
	case wakeTimeout:
		return event{kind: evTimeout}, true
	case wakeSock:
		k = l.lookSockets(ws.sock.Take())
	case wakeAlt:
		k = l.lookSockets(ws.alt.Take())
	case wakeSpare:
		k = l.lookSockets(ws.spare.Take())
	case wakeRecheck:
		k = l.look(0)
	case wakeEp:
		k = l.look(ws.ep.Take())
	}
	return event{kind: k}, k != evNone
}

// lookSockets looks at the loop's sockets after a wake-up (ev) of one of their paths:
// PrevSocketGone when a rollover's previous socket is no longer the file at its path (kubelet
// has withdrawn that registration; g's own is looked at next), SocketGone when g's is not.
func (l *loop) lookSockets(ev fswatch.Change) eventKind {
	if l.ro != nil && l.socks.replaced(0, l.ro.prev) {
		l.w.sockAgain, l.w.sockEv = true, ev
		return evPrevSocketGone
	}
	if l.socks.replaced(ev, l.cur) {
		return evSocketGone
	}
	return evNone
}

// waiting is the state of a loop's wait on one generation.
type waiting struct {
	g *generation
	// since is when the wait began; lifted, that kubelet registered g (lift).
	since    time.Time
	lifted   bool
	timeout  *time.Timer      // nil without a registration timeout
	timeoutC <-chan time.Time // nil once kubelet registered g, or without a timeout
	// Another socket matching the endpoint pattern is looked at again, sooner at first: it
	// may not answer yet, or the target may stop answering without its file going.
	recheck   *time.Timer
	recheckIn time.Duration
	// The endpoint's socket as this wait knows it; endpoint.probed stays the one the
	// registration was made or kept with until the loop probes the endpoint again, so that a
	// hand-over in between tells the next instance of a restart.
	epID fsid.ID
	// sockAgain: a rollover's previous socket went (PrevSocketGone); g's own socket is looked
	// at before the next sleep, after sockEv, the wake-up that showed it.
	sockAgain bool
	sockEv    fswatch.Change
	// next is what a look saw of the endpoint besides the rollover's old instance gone
	// (OldInstanceGone, reported first); None: nothing.
	next eventKind
	// moveOnVerdict: a newer instance answered while kubelet was registering g; the pattern
	// is looked at again once the verdict is in (see look).
	moveOnVerdict bool
	// verifyEnd fires when a device plugin's move has been verified long enough (nil until
	// one is).
	verifyEnd *time.Timer
}

// newWaiting begins a wait on g, the endpoint's socket last probed being epID: with a
// registration timeout (0: none) unless kubelet has registered g already (registered).
func newWaiting(g *generation, epID fsid.ID, timeout time.Duration, registered bool) *waiting {
	w := &waiting{g: g, since: time.Now(), lifted: registered, recheck: time.NewTimer(time.Hour), epID: epID}
	w.recheck.Stop()
	w.rearm(timeout)
	return w
}

// rearm sets the registration timeout to timeout (0: none) from the wait's beginning, unless
// kubelet has registered g; one already past fires at once.
func (w *waiting) rearm(timeout time.Duration) {
	if w.lifted {
		return
	}
	if w.timeout != nil {
		w.timeout.Stop()
	}
	w.timeout, w.timeoutC = nil, nil
	if timeout > 0 {
		w.timeout = time.NewTimer(max(0, time.Until(w.since.Add(timeout))))
		w.timeoutC = w.timeout.C
	}
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
	w.lifted, w.timeoutC = true, nil
	if w.timeout != nil {
		w.timeout.Stop()
	}
}

// look looks at the endpoint after a wake-up (ev; 0: none) and returns the event it sees:
// EndpointMoved, OldInstanceGone (a rollover's, once kubelet has registered cur: Registered),
// EndpointRestarted, EndpointDown, or None.
func (l *loop) look(ev fswatch.Change) eventKind {
	g, w, ep := l.cur, l.w, &l.ep
	if l.d.spec.EndpointIsPattern() {
		to, others := ep.newer(l.wctx)
		switch {
		case to == "":
		case l.socks.rollsOver(l.ro != nil) && !g.registered && g.awaiting():
			// kubelet asked g's GetInfo and its verdict is on its way: it may hold g's
			// registration already. Moving now would withdraw it; the new instance is
			// registered beside it once the verdict is in (await looks again then).
			if !w.moveOnVerdict {
				l.log.Info("a newer instance answers; it is registered beside this one once kubelet's verdict on this one is in",
					"endpoint", ep.at.local, "newer", to)
			}
			w.moveOnVerdict = true
		default:
			l.log.Info("driver endpoint moved", "from", ep.at.local, "to", to)
			return evEndpointMoved
		}
		oldGone := false
		if l.st == stRegistered && l.ro != nil {
			if oldGone = ep.gone(l.wctx, l.ro.prev.at); !oldGone {
				others = true
			}
		}
		w.recheckIn = nextRecheck(w.recheckIn, ev != 0, others)
		if w.recheckIn > 0 {
			w.recheck.Reset(w.recheckIn)
		}
		if oldGone {
			w.next = ep.change(ev, &w.epID)
			return evOldInstanceGone
		}
	}
	return ep.change(ev, &w.epID)
}
