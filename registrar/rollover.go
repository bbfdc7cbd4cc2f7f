package registrar

// rollover is an endpoint's move to a new instance through the driver's second registration
// socket (config.Driver.RollsOver): the new instance is registered while kubelet keeps the
// previous generation's registration, and that one is withdrawn only once the new one is
// registered and the old instance is gone, so that kubelet never holds none. A DRA driver rolls
// over always; a device plugin while kubelet's view can verify the move (devicemoves.go).
//
// A rollover starts when the endpoint pattern's target moves while kubelet holds the loop's
// registration (startRollover), or comes with a hand-over (startFrom). It ends when:
//   - it settles: kubelet registered the new instance's generation and the old instance is
//     gone (settle, OldInstanceGone), or the old socket was removed by someone else
//     (PrevSocketGone);
//   - it falls back: the new instance went, or a newer one came, before kubelet registered it,
//     and the loop goes back to the previous registration (fallBack; stFallingBack);
//   - the loop ends (Removed, Shutdown, HandOver).
//
// While it lasts, the driver's phase is Registered whatever the new instance's attempt goes
// through: kubelet holds the previous registration. A device plugin's move is verified in
// kubelet's view from its start until after the old registration is withdrawn (loop.mv).
type rollover struct {
	// prev is the generation whose registration kubelet holds meanwhile.
	prev *generation
}

// generation is the generation the rollover keeps registered; nil without a rollover.
func (r *rollover) generation() *generation {
	if r == nil {
		return nil
	}
	return r.prev
}

// startRollover keeps g, which kubelet has registered, while a new generation is published
// for the new instance.
func (l *loop) startRollover(g *generation) {
	l.ro = &rollover{prev: g}
	l.mv.start(true)
}

// fallBack ends the rollover by making its previous generation the current one again, and
// returns it: kubelet holds its registration. Its verdicts count again (kubelet asks anew when
// it restarts), and a verdict still pending for the generation left is dropped.
func (l *loop) fallBack() *generation {
	g := l.ro.prev
	l.ro = nil
	l.d.makeCurrent(g)
	l.d.setSocket(g.path)
	l.log.Info("back to the registration kubelet holds", "socket", g.path, "endpoint", g.at.local)
	return g
}

// settle withdraws what a rolling-over driver's registration no longer needs once kubelet has
// registered g: the rollover's previous generation when its endpoint is gone, and a socket an
// earlier run left in the other path that no one serves.
func (l *loop) settle(g *generation) {
	if l.ctx.Err() != nil {
		return // no look can tell whether the old instance is gone
	}
	if l.ro == nil {
		if l.d.spec.AltSocketPath == "" {
			return
		}
		for _, p := range l.d.spec.SocketPaths() {
			if p != g.path {
				l.socks.withdrawStale(p)
			}
		}
		return
	}
	if gone := l.ep.gone(l.ctx, l.ro.prev.at); gone && l.ctx.Err() == nil { // a look cut short decides nothing
		l.withdrawPrev(g)
	}
}

// withdrawPrev ends the rollover once kubelet has registered g and the old instance is gone:
// the previous generation is withdrawn.
func (l *loop) withdrawPrev(g *generation) {
	prev := l.ro.prev
	l.log.Info("the new instance is registered and the old one is gone; withdrawing the old registration",
		"socket", prev.path, "endpoint", prev.at.local)
	l.socks.withdraw(prev, true)
	l.ro = nil
	l.mv.withdrawn(g)
}
