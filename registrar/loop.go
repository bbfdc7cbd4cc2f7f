package registrar

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/cenkalti/backoff/v4"
	"multireg.dev/multireg/internal/probe"
)

// A driver's loop between its steps: what it does before it publishes, and after a
// generation's wait ends.

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
	// verifySwap: the next socket registers a device plugin's new instance in the other path
	// (swapsPaths): kubelet's view is read to verify the move (devicemoves.go).
	verifySwap bool
}

func (d *driver) newLoop(ctx context.Context) *loop {
	l := &loop{d: d, ctx: ctx, probeB: newBackoff(d.spec.Backoff), ws: d.subscribe(), a: d.adopted}
	d.adopted = nil
	if l.a != nil {
		l.cur = l.a.cur
	}
	d.startVerify() // a move handed over under way is verified as one begun here
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
		if _, mismatch := errors.AsType[*probe.NameMismatchError](err); mismatch {
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
			d.startVerify()
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
			switch {
			case cur == nil:
			case cur.path == g.path:
				cur.stop() // its file was just replaced by g's
			default:
				d.retire(cur) // kubelet deregisters it in the pass that registers g (swapsPaths)
				if l.verifySwap {
					d.verifySwap(g)
				}
			}
			l.verifySwap = false
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
	case endDevicesDropped:
		// kubelet holds cur's registration without the resource's devices: cur is registered
		// again (prepare publishes over it).
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
			l.verifySwap = d.swapsPaths()
		case d.prev != nil && (!cur.registered || d.gone(ctx, cur.at)):
			// The instance being registered went, or a newer one came, before kubelet
			// registered it; or the new instance went while the old one runs: go back to the
			// old registration, which kubelet holds and whose instance answers.
			d.retire(cur)
			l.cur = d.resume()
			l.resume = true
			// The new instance's registration went: an older device manager dropped the
			// resource's client with it, which kubelet's view shows.
			d.withdrawn(l.cur)
		case cur.registered:
			// kubelet holds cur: the registration stays with it until the new instance's is
			// made. An older one still kept is no longer needed.
			if d.prev != nil {
				d.retire(d.prev)
			}
			d.prev, l.cur = cur, nil
			d.startVerify()
			d.log.Info("driver endpoint moved; registering the new instance beside the old one")
		default:
			d.reregister("why", "the endpoint moved")
		}
	}
	return true
}
