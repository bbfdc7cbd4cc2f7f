package registrar

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/cenkalti/backoff/v4"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fswatch"
	"multireg.dev/multireg/internal/handover"
	"multireg.dev/multireg/internal/podres"
	"multireg.dev/multireg/internal/probe"
	"multireg.dev/multireg/internal/regserver"
)

// A driver's loop: everything it holds between its steps, in one struct, and its run. What it
// waits for in each state and what each event does are the table's (machine.go); the waits are
// in endpoint.go, await.go and the end of this file, the acts in transitions.go.

// env is what the loops of a supervisor share: set before a loop starts, never changed.
type env struct {
	w        *fswatch.Watcher
	hub      *regserver.Hub
	inFlight probe.InFlight
	// healthWaits bound the questions of a DRA driver's device health services in flight,
	// apart from inFlight: each waits for the driver's answer (health.go).
	healthWaits probe.InFlight
	// moves is what the loops know of how kubelet takes a device plugin's move to a new
	// endpoint, with kubelet's view of device-plugin resources (devicemoves.go).
	moves *deviceMoves
	// guard, if set, must pass before a socket is published: the process still holds the
	// registration directory.
	guard func() error
	// probe asks an endpoint whether it is ready (probe.Endpoint; tests replace it).
	probe   func(context.Context, config.Driver) error
	cleanup bool // remove the sockets on shutdown too
	// changes is told of each change of a driver's status (Supervisor.Changed).
	changes *changes
}

// loop is a driver's loop: its state, and everything the loop's goroutine alone uses.
type loop struct {
	d   *driver
	env *env
	// ctx is the loop's: it ends when the loop must (its cause says why: stopped). wctx is the
	// wait's under way, which a new policy ends too (driver.beginWait); acts use ctx.
	ctx  context.Context
	wctx context.Context
	log  *slog.Logger
	st   state

	// cur is the socket this loop serves: one it published, or one a hand-over gave it.
	cur *generation
	// ro is the endpoint's rollover to a new instance under way, if any (rollover.go).
	ro *rollover
	// mv is a device plugin's move being checked in kubelet's view (devicemoves.go).
	mv moveCheck
	// ep is the driver's endpoint as the loop knows it (endpoint.go).
	ep endpoint
	// socks are the driver's registration sockets' paths, and what the loop withdrew from
	// them (sockets.go).
	socks sockets
	// Two curves of the same policy: waiting for the endpoint (probeB), reset when it answers,
	// and registering (p), reset when kubelet accepts. A long outage of the endpoint must not
	// make the first registration failure after it wait the longest interval.
	p      *pacing
	probeB *backoff.ExponentialBackOff
	ws     watches

	// w is the wait on cur while the loop awaits kubelet's verdict or serves a registration
	// (await.go); nil in the other states. c is what its next sleep selects on.
	w *waiting
	c wakeups
	// a is what a hand-over told of the sockets it gave the loop (stTakingOver only).
	a *takeover
	// pub is where and from when the next generation is published (stPublishing only).
	pub publication
	// err and retryIn are why the loop backs off and for how long (stBackingOff only); err is
	// nil when a hand-over gave the loop the rest of a wait another instance began. retryAt
	// is when the wait ends, failedAt when the attempt failed (zero after a hand-over).
	err      error
	retryIn  time.Duration
	retryAt  time.Time
	failedAt time.Time
	// verifySwap: the next generation registers a device plugin's new instance in place of
	// the old one's registration (swapsPaths): kubelet's view is read to verify the move
	// (devicemoves.go).
	verifySwap bool
	// handed is what the loop hands over when it ends for a hand-over (handOver).
	handed *handover.Driver
}

// publication is where the next generation goes, and from when: a DRA driver's path once
// kubelet has let go of it (sockets.go: clearPaths). err, if set, is why it cannot be
// published: the attempt fails.
type publication struct {
	path string
	at   time.Time
	err  error
}

// run is the loop: it waits for what its state waits for, and steps on the event that ends the
// wait, until the loop stops. It returns only when everything it started has stopped.
//
// Its state is a loop, on the heap, and each wait and step is a call that returns before the
// next: the loop spends most of its life in await, and the runtime shrinks an idle goroutine's
// stack to what it holds there. With every step's locals on it, each of 1000 drivers would
// hold 8 KiB or more instead of 4.
//
// It returns what the loop handed over when it ended for a hand-over (HandOver), or nil.
func (d *driver) run(ctx context.Context, e *env, a *takeover) *handover.Driver {
	l := newLoop(ctx, d, e, a)
	defer l.ws.close()
	for l.st != stStopped {
		var ev event
		var endWait context.CancelFunc
		l.wctx, endWait = d.beginWait(l.ctx)
		if l.st.awaits() && l.wctx.Err() == nil {
			// await, inlined: a parked loop holds run's frame and sleep's only.
			for ev = l.awaitNext(); ev.kind == evNone; ev = l.awaitNext() {
				var ok bool
				if ev, ok = l.woke(l.c.sleep()); ok {
					break
				}
			}
			ev = l.cut(ev)
		} else {
			ev = l.wake()
		}
		endWait()
		// A new policy is taken before the event the wait reported, whatever ended the wait;
		// a wait it ended reported nothing else (Reload).
		if spec := d.takePolicy(); spec != nil {
			l.step(event{kind: evReload, spec: spec})
		}
		if ev.kind != evReload {
			l.step(ev)
		}
	}
	return l.handed
}

// newLoop is the loop of d, in the state a hand-over gave it (a: handover.go), or waiting for
// the endpoint.
func newLoop(ctx context.Context, d *driver, e *env, a *takeover) *loop {
	spec := d.spec
	l := &loop{
		d: d, env: e, ctx: ctx, log: d.log, st: stWaitingForEndpoint,
		ep:     newEndpoint(d, e),
		mv:     moveCheck{d: d, env: e, moves: e.moves},
		socks:  sockets{d: d, env: e},
		p:      newPacing(spec),
		probeB: newBackoff(spec.Backoff),
		ws:     subscribe(e.w, spec),
	}
	if a != nil {
		l.startFrom(a)
	}
	l.mv.start(l.ro != nil) // a move handed over under way is verified as one begun here
	d.show(l.shown())
	l.log.Debug("loop starts", "state", l.st)
	return l
}

// wake waits for what the loop's state waits for, and returns the event that ends the wait
// (cut: the end of the loop, or a new policy, when it cut the wait short).
func (l *loop) wake() event {
	if l.wctx.Err() != nil {
		return l.interrupted()
	}
	return l.cut(waits[l.st].wait(l))
}

// cut returns e, what a wait reported, or what ended the wait while it looked (interrupted):
// a look cut short decides nothing. kubelet's verdict is taken as it is: kubelet holds the
// registration, or refused it, whatever this process does next. A wait that reports what its
// state does not declare (waits) is a programming error.
func (l *loop) cut(e event) event {
	if l.wctx.Err() != nil && e.kind != evAccepted && e.kind != evRejected {
		return l.interrupted()
	}
	if !reports(l.st, e.kind) {
		panic(fmt.Sprintf("registrar: a wait in %s reported %s, which the state does not declare (machine.go: waits)", l.st, e.kind))
	}
	return e
}

// interrupted is the event of the wait's context's end: a new policy (Reload), or the loop's
// end (stopped).
func (l *loop) interrupted() event {
	if l.ctx.Err() == nil {
		return event{kind: evReload}
	}
	return l.stopped()
}

// stopped is the event of the loop's context's end, by its cause.
func (l *loop) stopped() event {
	switch cause := context.Cause(l.ctx); {
	case errors.Is(cause, errRemoved):
		return event{kind: evRemoved}
	case errors.Is(cause, errHandOver):
		return event{kind: evHandOver}
	}
	return event{kind: evShutdown}
}

// dropWaiting ends the wait on cur, if one was under way.
func (l *loop) dropWaiting() {
	if l.w != nil {
		l.w.stop()
		l.w = nil
	}
}

// shown is what the status shows of the loop's state (driver.show).
func (l *loop) shown() shownState { return l.shownAs(l.st) }

// shownAs is what the status shows of the loop in st, the rest of its state as it is: an act
// shows it before its step ends when what it does next takes time (registered), or when the
// loop does not step again (lateVerdict).
func (l *loop) shownAs(st state) shownState {
	s := shownState{st: st, rolling: l.ro != nil, waits: l.d.spec.WaitForEndpoint, keeps: l.ep.keepsOnRestart(l.cur)}
	switch {
	case st == stTakingOver && l.a != nil:
		s.handed = l.a.phase
	case st == stBackingOff:
		s.retryAt = l.retryAt
	}
	return s
}

// waitPath waits until the next generation's path is free (l.pub), and reports it.
func (l *loop) waitPath() event {
	if wait := time.Until(l.pub.at); wait > 0 {
		l.log.Debug("waiting until kubelet has let go of a registration path", "socket", l.pub.path, "wait", wait.Round(time.Millisecond))
		t := time.NewTimer(wait)
		defer t.Stop()
		select {
		case <-l.wctx.Done():
			return l.interrupted()
		case <-t.C:
		}
	}
	return event{kind: evPathFree}
}

// waitBackoff waits for the backoff interval, or for what blocks the socket's path to go.
func (l *loop) waitBackoff() event {
	if !l.socks.sleepBackoff(l.wctx, time.Until(l.retryAt), l.err, l.ws, &l.ep) {
		return l.interrupted()
	}
	return event{kind: evBackoffOver}
}

// settling is how long kubelet may still hold a registration socket after multireg removed
// it: it deregisters the socket in its next reconcile pass (every second), and registers
// nothing in that path within the same pass.
const settling = 2 * podres.Period
