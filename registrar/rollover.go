package registrar

import (
	"context"
	"io/fs"
	"slices"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/fswatch"
	"multireg.dev/multireg/internal/podres"
	"multireg.dev/multireg/internal/sockfile"
)

// rollover is an endpoint's move to a new instance through the driver's second registration
// socket (config.Driver.RollsOver): the new instance is registered while kubelet keeps the
// previous generation's registration, and that one is withdrawn only once the new one is
// registered and the old instance is gone, so that kubelet never holds none. A DRA driver rolls
// over always; a device plugin while kubelet's view can verify the move (devicemoves.go).
//
// A rollover starts when the endpoint pattern's target moves while kubelet holds the loop's
// registration (startRollover), or comes with a hand-over (inherit). It ends when:
//   - it settles: kubelet registered the new instance's generation and the old instance is
//     gone, or the old socket was removed by someone else (settleRollover, lookSockets);
//   - it falls back: the new instance went, or a newer one came, before kubelet registered it,
//     and the loop goes back to the previous registration (fallBack; stFallingBack);
//   - the loop stops (shutdown, detach).
//
// While it lasts, the driver's phase is Registered whatever the new instance's attempt goes
// through: kubelet holds the previous registration. A device plugin's move is verified in
// kubelet's view from its start until after the old registration is withdrawn (d.verify).
type rollover struct {
	// prev is the generation whose registration kubelet holds meanwhile.
	prev *generation
}

// rollsOver reports whether the loop rolls its registration over from one instance of its
// endpoint to the next through its second socket (config.Driver.RollsOver): a DRA driver's
// always, a device plugin's when its new instances are registered beside the old ones
// (devicemoves.go). A rollover under way is finished the way it started.
func (d *driver) rollsOver() bool {
	return d.spec.AlwaysRollsOver() || d.spec.RollsOver() && (d.ro != nil || d.moves.beside())
}

// startRollover keeps g, which kubelet has registered, while a new generation is published
// for the new instance.
func (d *driver) startRollover(g *generation) {
	d.ro = &rollover{prev: g}
	d.startVerify()
}

// prevGeneration is the generation a rollover keeps registered; nil without a rollover.
func (d *driver) prevGeneration() *generation {
	if d.ro == nil {
		return nil
	}
	return d.ro.prev
}

// fallBack ends the rollover by making its previous generation the current one again, and
// returns it: kubelet holds its registration. Its verdicts count again (kubelet asks anew when
// it restarts), and a verdict still pending for the generation left is dropped.
func (d *driver) fallBack() *generation {
	g := d.ro.prev
	d.ro = nil
	d.makeCurrent(g)
	d.setSocket(g.path)
	d.log.Info("back to the registration kubelet holds", "socket", g.path, "endpoint", g.at.local)
	return g
}

// settleRollover withdraws what a rolling-over driver's registration no longer needs, once
// kubelet has registered g: the rollover's previous generation when its endpoint is gone, and
// a socket an earlier run left in the other path that no one serves.
func (d *driver) settleRollover(ctx context.Context, g *generation) {
	if ctx.Err() != nil {
		return // no look can tell whether the old instance is gone
	}
	if d.ro == nil {
		if d.spec.AltSocketPath == "" {
			return
		}
		for _, p := range d.spec.SocketPaths() {
			if p != g.path {
				d.removeStale(p)
			}
		}
		return
	}
	if prev := d.ro.prev; d.gone(ctx, prev.at) {
		d.log.Info("the new instance is registered and the old one is gone; withdrawing the old registration",
			"socket", prev.path, "endpoint", prev.at.local)
		d.retire(prev)
		d.ro = nil
		d.withdrawn(g)
	}
}

// lookSockets looks at the loop's sockets after a wake-up (ev) of one of their paths, and
// reports whether another file, or none, is at g's path. A rollover whose previous socket went
// ends there: kubelet has withdrawn that registration, and the new one is being made.
func (d *driver) lookSockets(ev fswatch.Change, g *generation) bool {
	if d.ro != nil && d.socketReplaced(0, d.ro.prev) {
		d.log.Info("the old instance's registration socket was removed", "socket", d.ro.prev.path)
		d.ro.prev.stop()
		d.ro = nil
		if g.registered {
			d.withdrawn(g)
		}
		if !g.registered { // kubelet holds none of ours now
			d.update(Serving, "", time.Time{})
		}
	}
	return d.socketReplaced(ev, g)
}

// publishPath is where the next generation is published: over cur, which it replaces, or for
// a device plugin with several sockets in another one (swapsPaths); for a rollover, in a path
// the previous generation does not hold, so that kubelet keeps a registration until the new one
// is made. Otherwise a device plugin that rolls over publishes over a socket an earlier run of
// multireg left, keeping one: the first of the paths where a socket is, the others' removed
// (kubelet still holds the first's meanwhile). A DRA driver outside a rollover publishes where
// clearPath says instead (withdrawsFirst).
func (d *driver) publishPath(cur *generation) string {
	switch {
	case cur != nil && d.swapsPaths():
		return d.freePath(cur.path)
	case cur != nil:
		return cur.path
	case !d.rollsOver():
		return d.spec.SocketPath
	case d.ro != nil:
		return d.freePath(d.ro.prev.path)
	}
	paths := d.spec.SocketPaths()
	keep := slices.IndexFunc(paths, func(p string) bool {
		_, _, err := fsid.Stat(p)
		return err == nil
	})
	if keep < 0 {
		return d.spec.SocketPath
	}
	for _, p := range paths[keep+1:] {
		if _, _, err := fsid.Stat(p); err == nil {
			d.removeStale(p)
		}
	}
	return paths[keep]
}

// swapsPaths reports whether a device plugin with several registration sockets registers again
// in a path kubelet does not hold (freePath), the one it holds being removed right after
// (evPublished): kubelet deregisters the one and registers the other in the same reconcile
// pass, deregistering first. Registered again in the same path, kubelet would deregister the
// old socket in one pass and register the new one only in the next (both are operations on
// one path, and one waits for the other), and its device manager holds no client for the
// resource meanwhile.
func (d *driver) swapsPaths() bool {
	return d.spec.Type == config.DevicePlugin && d.spec.AltSocketPath != "" && d.ro == nil
}

// settling is how long kubelet may still hold a registration socket after multireg removed
// it: it deregisters the socket in its next reconcile pass (every second), and registers
// nothing in that path within the same pass.
const settling = 2 * podres.Period

// freePath is the path to register in beside, or in place of, the registration at held: the
// first of the driver's other paths that kubelet does not hold, as far as multireg knows (no
// socket of its own withdrawn from there within settling). A device plugin's third path is
// there for when kubelet may hold both others; with none free, the other of two.
func (d *driver) freePath(held string) string {
	for _, p := range d.spec.SocketPaths() {
		if p != held && time.Since(d.withdrawnAt[p]) >= settling {
			return p
		}
	}
	return d.otherSocket(held)
}

// otherSocket is the registration socket path of a rolling-over driver that is not path.
func (d *driver) otherSocket(path string) string {
	if path == d.spec.SocketPath {
		return d.spec.AltSocketPath
	}
	return d.spec.SocketPath
}

// withdrawsFirst reports whether the next generation is published only once every socket
// kubelet may hold for the driver is gone, and in a path kubelet holds no registration of
// (clearPath): a DRA driver's, outside a rollover.
//
// kubelet's DRA manager refuses a second registration of one (name, endpoint), and its plugin
// manager can lose the first one's deregistration. Its reconciler looks for sockets to
// unregister (gone, or recreated at their path) before it looks for sockets to register, each
// pass from its own reading of the directory (pkg/kubelet/pluginmanager/reconciler,
// reconcile): a socket recreated at a path kubelet holds, between the two looks, is registered
// before the old one is unregistered. The registration replaces the old one's entry in
// kubelet's actual state (operationexecutor's GenerateRegisterPluginFunc: AddPlugin, keyed by
// path), the DRA manager refuses the endpoint it still holds, and from kubelet 1.36 the failed
// registration removes the path's entry: nothing is left to deregister the old (name,
// endpoint), and the DRA manager refuses every later registration of it until kubelet
// restarts. A socket published in a path that holds none, once the old one is removed, is at
// worst refused once, in the pass that unregisters the old one, and registered at the next
// attempt.
func (d *driver) withdrawsFirst() bool {
	return d.spec.Type == config.DRAPlugin && d.ro == nil
}

// clearPath removes the sockets at the driver's paths that kubelet may hold (an earlier run's,
// or one this run lost track of), and returns where to publish the next generation: the first
// path from which no socket was withdrawn within settling, after waiting for one to settle if
// each was. A driver with one path publishes there again once kubelet has let go of it; one
// with two (an endpoint pattern) at once in the other. A socket another process serves, or a
// file that is not a socket, is left alone, and its path returned: the publication there fails
// and waits until it is gone, as for any driver (sockfile.ServedError, sockfile.NotSocketError).
// It reports false when ctx ends first.
func (d *driver) clearPath(ctx context.Context) (string, bool) {
	for _, p := range d.spec.SocketPaths() {
		id, mode, err := fsid.Stat(p)
		if err != nil {
			continue
		}
		if mode != fs.ModeSocket || sockfile.AnswersGetInfo(p) {
			return p, true
		}
		removed, err := sockfile.RemoveIfOurs(p, id)
		if err != nil {
			d.log.Warn("remove stale registration socket", "socket", p, "err", err)
		}
		if removed {
			d.markWithdrawn(p)
			d.log.Info("removed a registration socket kubelet may hold; the next one is published once kubelet cannot hold its path", "socket", p)
		}
	}
	paths := d.spec.SocketPaths()
	next := paths[0]
	for _, p := range paths {
		if time.Since(d.withdrawnAt[p]) >= settling {
			return p, true
		}
		if d.withdrawnAt[p].Before(d.withdrawnAt[next]) {
			next = p
		}
	}
	wait := settling - time.Since(d.withdrawnAt[next])
	d.log.Debug("waiting until kubelet has let go of a registration path", "socket", next, "wait", wait.Round(time.Millisecond))
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return "", false
	case <-t.C:
		return next, true
	}
}

// markWithdrawn records that a socket kubelet may hold left path just now (freePath,
// clearPath), for a driver with several paths or a DRA driver.
func (d *driver) markWithdrawn(path string) {
	if d.spec.AltSocketPath == "" && d.spec.Type != config.DRAPlugin {
		return
	}
	if d.withdrawnAt == nil {
		d.withdrawnAt = map[string]time.Time{}
	}
	d.withdrawnAt[path] = time.Now()
}
