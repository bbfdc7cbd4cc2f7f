package registrar

import (
	"context"
	"fmt"
	"path/filepath"
	"time"

	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/fswatch"
)

// How a loop waits on a published generation: kubelet's verdict, its timeout, the sockets
// and the endpoint watched.

// await serves generation g until something ends it, and says why: kubelet rejected it or no
// verdict came within the timeout in force (both with an error that says so), the socket was
// removed or replaced, or the endpoint, probed as d.probed, restarted or (a pattern) moved. It
// returns endStopped when ctx ends. A generation kubelet has already registered (registered)
// has no timeout. The loop waits here most of its life: its state is a waiting, on the heap,
// and the work of each wake-up is done in calls that return (see run).
func (d *driver) await(ctx context.Context, g *generation, registered bool, ws watches) (ending, error) {
	w := d.newWaiting(ctx, g, registered)
	defer w.stop()
	var altC, spareC <-chan struct{}
	if ws.alt != nil {
		altC = ws.alt.C()
	}
	if ws.spare != nil {
		spareC = ws.spare.C()
	}
	if end := w.look(0); end != endStopped { // a first look: is the endpoint up?
		return end, nil
	}
	for {
		// Watched before it is read: a reading in between wakes the next select.
		viewC := w.watchView()
		if d.checkVerify(g) {
			return endDevicesDropped, nil
		}
		verifyC := w.verifyTimer()
		select {
		case <-viewC:
			if d.verify != nil && d.verify.until.IsZero() && d.prev != nil && g.registered {
				// kubelet's view changed while the old registration stays: its instance
				// may be gone.
				if end := w.look(0); end != endStopped {
					return end, nil
				}
			}
		case <-verifyC:
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
		case <-spareC:
			if d.socketsGone(ws.spare.Take(), g) {
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
	// verifyEnd fires when a device plugin's move has been verified long enough (nil until
	// one is).
	verifyEnd *time.Timer
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
	if w.verifyEnd != nil {
		w.verifyEnd.Stop()
	}
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
	switch v := w.d.takeVerdict(w.g); {
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
