package registrar

import (
	"context"
	"errors"
	"fmt"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/regdir"
	"multireg.dev/multireg/internal/sockfile"
)

// The acts of the table's rows (machine.go): each takes the loop in the row's state and the
// event that ended its wait, does everything kubelet can see (publishing, withdrawing,
// stopping a socket) and every change of the loop's state, and returns the state the loop
// goes on in. Nothing else does either.

// upWaiting: the endpoint answers while the loop waits for it.
func upWaiting(l *loop, e event) state {
	l.tookEndpoint(e.up)
	if l.cur == nil && l.ro != nil && l.ro.prev.at == l.ep.at {
		// The new instance's attempt failed and it went: the old one is the one to
		// register, and kubelet holds it already (a second socket for it would be refused).
		l.cur = l.fallBack()
		return stRegistered
	}
	return l.publishing()
}

// upRestarting: the restarted driver answers while kubelet holds cur's registration.
func upRestarting(l *loop, e event) state {
	l.ep.takeUp(e.up)
	l.probeB.Reset()
	if l.cur.at == l.ep.at {
		keeps, decided := l.ep.keepsRegistration(l.ctx, l.cur)
		if !decided {
			return stRestarting
		}
		l.ep.probed, l.ep.probedAt = e.up.id, e.up.probedAt
		if keeps {
			return stRegistered
		}
	}
	l.ep.probed, l.ep.probedAt = e.up.id, e.up.probedAt
	return l.publishing()
}

// upFallingBack: the endpoint answers while the loop is back on a rollover's previous
// registration.
func upFallingBack(l *loop, e event) state {
	l.tookEndpoint(e.up)
	if l.cur.at == l.ep.at {
		return stRegistered
	}
	// A newer instance answers: roll over to it from the registration kubelet holds.
	l.startRollover(l.cur)
	l.cur = nil
	return l.publishing()
}

// renamed: the driver answers under another name while its socket is served: kubelet must
// not keep it.
func renamed(l *loop, e event) state {
	if l.st == stRestarting {
		l.ep.countReregistration()
	}
	l.log.Warn("driver reports another name; its registration is withdrawn", "err", e.err)
	l.socks.withdraw(l.cur, true)
	l.cur, l.a = nil, nil
	return stWaitingForEndpoint
}

// publish publishes the next generation where publishing chose.
func publish(l *loop, _ event) state {
	g, err := (*generation)(nil), l.pub.err
	if err == nil {
		g, err = l.socks.publish(l.pub.path, l.cur, l.ep.at, l.ep.versions())
	}
	if err != nil {
		l.d.record(outPublishFailed)
		return l.backOff(fmt.Errorf("publish socket: %w", err))
	}
	switch cur := l.cur; {
	case cur == nil:
	case cur.path == g.path:
		cur.stop() // its file was just replaced by g's
	default:
		l.socks.withdraw(cur, true) // kubelet deregisters it in the pass that registers g (swapsPaths)
		if l.verifySwap {
			l.mv.startSwap(g)
		}
	}
	l.verifySwap = false
	l.cur = g
	return stAwaitingVerdict
}

// accepted: kubelet registered cur. Taken even as the loop ends: kubelet holds the
// registration, and a hand-over hands it over as such.
func accepted(l *loop, _ event) state {
	l.w.lift()
	// A verdict taken as the loop ends asks NodeGetInfo all the same, for the loop it is
	// handed over to: the call has its own timeout.
	l.registered(context.WithoutCancel(l.ctx), l.cur)
	l.settle(l.cur)
	l.mv.startRepair(l.cur) // the registration that repairs a drop, if it is one, is checked
	return stRegistered
}

// rejected: kubelet refused cur, which it holds no registration of.
func rejected(l *loop, e event) state {
	l.d.record(outRejected)
	l.socks.withdraw(l.cur, false)
	l.cur = nil
	return l.backOff(e.err)
}

// timedOut: no verdict within the registration timeout; the next attempt allows longer.
func timedOut(l *loop, _ event) state {
	allowed := l.p.timeout
	err := fmt.Errorf("no registration verdict from kubelet within %s; the next attempt allows %s", allowed, l.p.timedOut())
	l.d.record(outTimeout)
	l.socks.withdraw(l.cur, true)
	l.cur = nil
	return l.backOff(err)
}

// socketGone: cur's socket was removed or replaced by someone else: published again at once.
func socketGone(l *loop, _ event) state {
	l.d.record(outSocketGone)
	l.cur.stop()
	l.socks.markWithdrawn(l.cur.path) // kubelet holds it until its next reconcile pass
	l.cur = nil
	l.log.Info("registration socket removed or replaced; recreating it", "socket", l.d.spec.SocketPath)
	return stWaitingForEndpoint
}

// prevSocketGone: a rollover's previous socket was removed by someone else: kubelet has
// withdrawn that registration, and the rollover ends.
func prevSocketGone(l *loop, _ event) state {
	prev := l.ro.prev
	l.log.Info("the old instance's registration socket was removed", "socket", prev.path)
	prev.stop()
	l.ro = nil
	if l.cur.registered {
		l.mv.withdrawn(l.cur)
	}
	return l.st
}

// oldInstanceGone: kubelet registered the new instance and the old one is gone.
func oldInstanceGone(l *loop, _ event) state {
	l.withdrawPrev(l.cur)
	return l.st
}

// endpointDown: the registration stays, as with sidecars: a crashing driver must not
// deregister (and a DRA driver's deregistration wipes its ResourceSlices after 30 s).
func endpointDown(l *loop, _ event) state {
	l.log.Warn("driver endpoint is gone; the registration stays until it comes back", "endpoint", l.ep.at.local)
	return l.st
}

// endpointRestarted: the driver restarted. The old socket is served while the driver comes
// up again; a new one, if the driver needs one, replaces it.
func endpointRestarted(l *loop, _ event) state {
	l.d.countRestart()
	if l.ep.keepsOnRestart(l.cur) {
		return stRestarting
	}
	l.ep.countReregistration()
	return stWaitingForEndpoint
}

// endpointMoved: the endpoint pattern's target moved to another socket while cur is awaited
// or registered: a rollover to the new instance starts or falls back, or the driver is
// registered again under the new path.
func endpointMoved(l *loop, _ event) state {
	cur := l.cur
	switch {
	case !l.socks.rollsOver(l.ro != nil):
		l.ep.countReregistration("why", "the endpoint moved")
		l.verifySwap = l.socks.swapsPaths(l.ro != nil)
	case l.ro != nil && !cur.registered:
		// The instance being registered went, or a newer one came, before kubelet registered
		// it: back to the old registration.
		return l.fallBackFrom(cur)
	case l.ro != nil && l.ep.gone(l.ctx, cur.at):
		if l.ctx.Err() != nil {
			return l.st // a look cut short by the end decides nothing
		}
		// The new instance went while the old one runs: back to the old registration.
		return l.fallBackFrom(cur)
	case cur.registered:
		// kubelet holds cur: the registration stays with it until the new instance's is made.
		// An older one still kept is no longer needed.
		if l.ro != nil {
			l.socks.withdraw(l.ro.prev, true)
		}
		l.startRollover(cur)
		l.cur = nil
		l.log.Info("driver endpoint moved; registering the new instance beside the old one")
	default:
		l.ep.countReregistration("why", "the endpoint moved")
	}
	return stWaitingForEndpoint
}

// fallBackFrom withdraws cur, a rollover's new instance's registration, and goes back to the
// previous one, which kubelet holds and whose instance answers.
func (l *loop) fallBackFrom(cur *generation) state {
	l.socks.withdraw(cur, true)
	l.cur = l.fallBack()
	// The new instance's registration went: an older device manager dropped the resource's
	// client with it, which kubelet's view shows.
	l.mv.withdrawn(l.cur)
	return stFallingBack
}

// devicesDropped: kubelet holds cur's registration without the resource's devices: cur is
// registered again, in a path kubelet does not hold (publishing replaces it: swapsPaths).
func devicesDropped(l *loop, _ event) state {
	l.mv.dropped()
	l.d.record(outDevicesDropped)
	return stWaitingForEndpoint
}

// moveVerified: a device plugin's move needs no more reading of kubelet's view.
func moveVerified(l *loop, _ event) state {
	l.mv.end(l.cur)
	return l.st
}

// backoffOver: the next attempt begins.
func backoffOver(*loop, event) state { return stWaitingForEndpoint }

// reload: the driver's new loop policy (config.Policy): what it registers is what the loop
// registers already. The wait it ended begins again under it: a backoff interval under way
// is the new curve's for the same failure, counted from the failure; a registration timeout
// under way counts the new timeout from the socket's publication; waiting for the endpoint
// (or not: waitForEndpoint) follows it at once.
func reload(l *loop, e event) state {
	wait := l.applyPolicy(*e.spec)
	switch {
	case l.st == stBackingOff && wait > 0:
		from := l.failedAt
		if from.IsZero() { // a wait a hand-over gave: counted from now
			from = time.Now()
		}
		l.retryIn, l.retryAt = wait, from.Add(wait)
		l.log.Info("the backoff under way follows the new policy", "nextAttempt", l.retryAt.Format(time.RFC3339Nano))
	case l.st.awaits() && l.w != nil:
		l.w.rearm(l.p.timeout)
	}
	return l.st
}

// removed: the driver left the configuration (or an edit registers it anew): its sockets are
// withdrawn, and kubelet deregisters it.
func removed(l *loop, _ event) state {
	l.end(true)
	return stStopped
}

// shutdown: the process stops. The sockets stay, so that a restarting multireg does not
// deregister every plugin at once, unless cleanup was asked for; after the directory was lost
// to another instance nothing is removed: the sockets are that instance's.
func shutdown(l *loop, _ event) state {
	l.end(l.env.cleanup && !errors.Is(context.Cause(l.ctx), regdir.ErrDirLost))
	return stStopped
}

// handOver: the loop's sockets go to another instance, listening, with what the loop knows
// (handover.go). A policy not yet taken is taken first: the loop is handed over with it.
func handOver(l *loop, _ event) state {
	if spec := l.d.takePolicy(); spec != nil {
		l.applyPolicy(*spec)
	}
	l.dropWaiting()
	l.handed = l.handOverState()
	return stStopped
}

// tookEndpoint takes what a wait for the endpoint saw, and resets the wait's backoff.
func (l *loop) tookEndpoint(up *endpointUp) {
	l.ep.takeUp(up)
	l.ep.probed, l.ep.probedAt = up.id, up.probedAt
	l.probeB.Reset()
}

// publishing readies the next generation's publication (l.pub) and returns stPublishing: over
// cur, or where the driver's rollover puts it (sockets.publishPath); for a driver that
// withdraws first, once cur and every other socket kubelet may hold for it are withdrawn, in a
// path kubelet does not hold (sockets.clearPaths).
func (l *loop) publishing() state {
	l.ep.nodeInfo = nil // asked again once kubelet has registered the new socket
	switch {
	case !l.socks.withdrawsFirst(l.ro != nil):
		l.pub = publication{path: l.socks.publishPath(l.cur, l.ro.generation(), l.socks.swapsPaths(l.ro != nil), l.socks.rollsOver(l.ro != nil))}
	default:
		if err := l.socks.checkGuard(); err != nil {
			l.pub = publication{err: err} // the sockets may be another instance's now
			break
		}
		if l.cur != nil {
			l.socks.withdraw(l.cur, true)
			l.cur = nil
		}
		l.pub = l.socks.clearPaths()
	}
	return stPublishing
}

// registered records that kubelet registered g: the backoff and the timeout start afresh, and
// a CSI driver is asked what kubelet has just learnt of it, for the comparison after a restart
// (restart.go). It is asked only now: a call before kubelet's own would be one more for the
// driver to answer, and could take a failure meant for kubelet.
func (l *loop) registered(ctx context.Context, g *generation) {
	g.registered = true
	l.p.registered()
	l.d.record(outRegistered)
	l.d.show(l.shownAs(stRegistered)) // kubelet holds it now, whatever the questions below take
	l.ep.recordNodeInfo(ctx)
}

// backOff records the failed attempt err and returns stBackingOff: the loop waits for the
// next attempt.
func (l *loop) backOff(err error) state {
	wait := l.p.wait()
	l.failedAt = time.Now()
	l.err, l.retryIn, l.retryAt = err, wait, l.failedAt.Add(wait)
	_, held := errors.AsType[*sockfile.ServedError](err)
	l.d.countFailure(err.Error(), held)
	l.d.show(l.shownAs(stBackingOff))
	l.log.Warn("registration failed", "err", err, "retryIn", wait.Round(time.Millisecond))
	return stBackingOff
}

// applyPolicy takes spec's loop policy (config.Policy) and what status shows of it
// (config.Display), and returns the wait the new backoff curve gives the last failure (0:
// none since the last registration).
func (l *loop) applyPolicy(spec config.Driver) time.Duration {
	was := l.d.spec.Policy
	l.d.spec.Policy, l.d.spec.Display = spec.Policy, spec.Display // what a hand-over hands over, or Resume resumes
	if spec.Policy == was {
		l.log.Debug("what status shows of the driver updated")
		return 0
	}
	wait := l.p.setPolicy(spec)
	l.probeB = newBackoff(spec.Backoff)
	if !nodeInfoTracked(l.d.spec) {
		l.ep.nodeInfo = nil // not asked of a driver multireg does not talk to: its next restart registers it again
	}
	l.log.Info("loop policy updated; the registration stays", "backoff", spec.Backoff, "registrationTimeout", spec.RegistrationTimeout,
		"waitForEndpoint", spec.WaitForEndpoint, "required", spec.Required)
	return wait
}

// end stops the loop's sockets as it ends: withdrawn (remove), or stopped, their files kept.
func (l *loop) end(remove bool) {
	l.dropWaiting()
	for _, g := range []*generation{l.ro.generation(), l.cur} {
		switch {
		case g == nil:
		case remove:
			l.socks.withdraw(g, true)
		default:
			g.stop()
		}
	}
	l.ro = nil
	if !remove {
		return
	}
	// A socket left by an earlier run of multireg that this run never replaced.
	for _, path := range l.d.spec.SocketPaths() {
		l.socks.withdrawStale(path)
	}
	l.log.Info("registration socket removed; kubelet deregisters the plugin", "socket", l.d.spec.SocketPath)
}
