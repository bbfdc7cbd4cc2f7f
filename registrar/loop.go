package registrar

import (
	"context"
	"errors"
	"time"

	"github.com/cenkalti/backoff/v4"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/probe"
)

// A driver's loop: what it holds between its steps, and what it waits for in each state (its
// activity, which returns the event that ends the wait). step (machine.go) acts on the event.

// loop is the state of a driver's loop between its steps.
type loop struct {
	d   *driver
	ctx context.Context
	st  state
	// Two curves of the same policy: waiting for the endpoint (probeB), reset when it answers,
	// and registering (d.p), reset when kubelet accepts. A long outage of the endpoint must not
	// make the first registration failure after it wait the longest interval.
	probeB *backoff.ExponentialBackOff
	ws     watches

	// cur is the socket this loop serves: one it published, or one a hand-over gave it.
	cur *generation
	// w is the wait on cur while the loop awaits kubelet's verdict or serves a registration
	// (await.go); nil in the other states. c is what its next sleep selects on.
	w *waiting
	c wakeups
	// a is what a hand-over told of the sockets it gave the loop (stTakingOver only).
	a *adoption
	// err and retryIn are why the loop backs off and for how long (stBackingOff only); err is
	// nil when a hand-over gave the loop the rest of a wait another instance began.
	err     error
	retryIn time.Duration
	// verifySwap: the next generation registers a device plugin's new instance in place of
	// the old one's registration (swapsPaths): kubelet's view is read to verify the move
	// (devicemoves.go).
	verifySwap bool
}

// run is the loop: it waits for what its state waits for, and steps on the event that ends the
// wait, until the loop stops (ctx ends). It returns only when everything it started has
// stopped.
//
// Its state is a loop, on the heap, and each wait and step is a call that returns before the
// next: the loop spends most of its life in await, and the runtime shrinks an idle goroutine's
// stack to what it holds there. With every step's locals on it, each of 1000 drivers would
// hold 8 KiB or more instead of 4.
func (d *driver) run(ctx context.Context) {
	l := d.newLoop(ctx)
	defer l.end()
	for l.st != stStopped {
		var e event
		if l.st.awaits() && l.ctx.Err() == nil {
			// await, inlined: a parked loop holds run's frame and sleep's only.
			for e = l.awaitNext(); e.kind == evNone; e = l.awaitNext() {
				var ok bool
				if e, ok = l.woke(l.c.sleep()); ok {
					break
				}
			}
		} else {
			e = l.wake()
		}
		if spec := d.takePolicy(); spec != nil {
			l.step(event{kind: evReload, spec: spec})
		}
		l.step(e)
	}
}

// newLoop starts the loop in the state a hand-over gave it (inherit.go), or waiting for the
// endpoint.
func (d *driver) newLoop(ctx context.Context) *loop {
	l := &loop{d: d, ctx: ctx, st: stWaitingForEndpoint, probeB: newBackoff(d.spec.Backoff), ws: d.subscribe()}
	if a := d.adopted; a != nil {
		d.adopted = nil
		switch {
		case a.cur != nil:
			l.st, l.cur, l.a = stTakingOver, a.cur, a
		case !a.nextAttempt.IsZero():
			// A backing-off driver: it waits until the next attempt the other instance had
			// planned.
			l.st, l.retryIn = stBackingOff, time.Until(a.nextAttempt)
		}
	}
	d.startVerify() // a move handed over under way is verified as one begun here
	d.log.Debug("loop starts", "state", l.st)
	return l
}

// end stops what the loop started, as the cause of its context's end says (shutdown), then its
// watches. A policy not yet taken is taken first: a hand-over hands the driver over with it.
func (l *loop) end() {
	if spec := l.d.takePolicy(); spec != nil {
		l.applyPolicy(*spec)
	}
	l.dropWaiting()
	l.d.shutdown(context.Cause(l.ctx), l.cur)
	l.ws.close()
}

// wake waits for what the loop's state waits for, and returns the event that ends the wait. A
// loop whose context has ended waits for nothing: it stops.
func (l *loop) wake() event {
	if l.ctx.Err() != nil {
		return l.stopped()
	}
	switch l.st {
	case stWaitingForEndpoint, stTakingOver, stRestarting, stFallingBack:
		return l.waitEndpoint()
	case stPublishing:
		return l.publish()
	case stAwaitingVerdict, stRegistered:
		return l.await()
	case stBackingOff:
		if !l.d.sleepBackoff(l.ctx, l.retryIn, l.err, l.ws) {
			return l.stopped()
		}
		return event{kind: evBackoffOver}
	}
	return l.stopped()
}

// stopped is the event of the loop's context's end, by its cause.
func (l *loop) stopped() event {
	switch cause := context.Cause(l.ctx); {
	case errors.Is(cause, errRemoved):
		return event{kind: evRemoved}
	case errors.Is(cause, errHandOff):
		return event{kind: evHandOff}
	}
	return event{kind: evShutdown}
}

// waitEndpoint waits until the endpoint answers (EndpointUp), or answers under another name
// while cur is served (EndpointRenamed: that socket must go first).
func (l *loop) waitEndpoint() event {
	ep, err := l.d.readyEndpoint(l.ctx, l.probeB, l.ws.ep, l.cur)
	if _, renamed := errors.AsType[*probe.NameMismatchError](err); renamed {
		return event{kind: evEndpointRenamed, err: err}
	}
	if err != nil {
		return l.stopped()
	}
	return event{kind: evEndpointUp, ep: ep}
}

// publish publishes the next generation: over cur, or where the driver's rollover puts it
// (publishPath); for a driver that withdraws first, once cur and every other socket kubelet may
// hold for it are gone, in a path kubelet does not hold (clearPath).
func (l *loop) publish() event {
	d := l.d
	d.nodeInfo = nil // asked again once kubelet has registered the new socket
	var path string
	if d.withdrawsFirst() {
		if err := d.checkGuard(); err != nil {
			return event{kind: evPublishFailed, err: err} // the sockets may be another instance's now
		}
		if l.cur != nil {
			d.retire(l.cur)
			l.cur = nil
		}
		var ok bool
		if path, ok = d.clearPath(l.ctx); !ok {
			return l.stopped()
		}
	} else {
		path = d.publishPath(l.cur)
	}
	g, err := d.publish(path, l.cur)
	if err != nil {
		return event{kind: evPublishFailed, err: err}
	}
	return event{kind: evPublished, g: g}
}

// dropWaiting ends the wait on cur, if one was under way.
func (l *loop) dropWaiting() {
	if l.w != nil {
		l.w.stop()
		l.w = nil
	}
}

// applyPolicy takes spec's loop policy (config.Policy): what spec registers is what the loop
// registers already. Every wait from the next one on follows it; a wait under way (a
// backoff interval, a registration timeout, a probe's interval) runs its course.
func (l *loop) applyPolicy(spec config.Driver) {
	d := l.d
	d.spec.Policy = spec.Policy
	d.p.setPolicy(spec)
	l.probeB = newBackoff(spec.Backoff)
	if !nodeInfoTracked(d.spec) {
		d.nodeInfo = nil // not asked of a driver multireg does not talk to: its next restart registers it again
	}
	d.log.Info("loop policy updated; the registration stays", "backoff", spec.Backoff, "registrationTimeout", spec.RegistrationTimeout,
		"waitForEndpoint", spec.WaitForEndpoint, "required", spec.Required)
}
