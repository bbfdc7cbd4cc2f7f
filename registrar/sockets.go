package registrar

import (
	"context"
	"errors"
	"io/fs"
	"net"
	"path/filepath"
	"slices"
	"time"

	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/fswatch"
	"multireg.dev/multireg/internal/regserver"
	"multireg.dev/multireg/internal/sockfile"
)

// A driver's registration sockets as its loop handles them: publishing a generation,
// withdrawing one (removing its file, so that kubelet deregisters it), and the path the next
// one goes to. One word each: a socket is published, stopped (served no more, its file kept),
// or withdrawn (stopped and its file removed); a socket kubelet may hold keeps its path busy
// for a moment after it is withdrawn (settling).

// sockets are a driver's registration sockets' paths, and what its loop withdrew from them.
// Only the loop's goroutine uses them.
type sockets struct {
	d   *driver
	env *env
	// withdrawnAt is when the loop last withdrew, or lost, a socket kubelet may hold from each
	// registration path: kubelet may hold it until its next reconcile pass (freePath,
	// clearPaths). Kept by drivers with several paths, and by DRA drivers; nil until then.
	withdrawnAt map[string]time.Time
}

// publish creates the next socket generation at path and serves it, telling kubelet the
// endpoint t and versions. cur, if not nil, is the loop's current generation, whose socket may
// be at path: only a socket of ours is replaced.
func (s *sockets) publish(path string, cur *generation, t target, versions []string) (*generation, error) {
	d := s.d
	gen, prev := d.nextGen()
	var id fsid.ID
	err := s.checkGuard()
	if err == nil {
		var ours fsid.ID
		if cur != nil && cur.path == path {
			ours = cur.id
		}
		err = sockfile.CheckNotServed(path, ours)
	}
	var claim *regserver.Claim
	if err == nil {
		// The socket's descriptor, claimed before it is created: sockets never take the
		// descriptors the rest of the process needs.
		claim, err = s.env.hub.Claim(path)
	}
	defer claim.Release()
	var g *generation
	if err == nil {
		// Served before it is renamed onto path: a failure to serve must not replace cur.
		_, id, err = sockfile.Publish(path, func(l *net.UnixListener) (func(), error) {
			var err error
			g, err = s.serve(l, path, fsid.ID{}, gen, t, versions, false, claim)
			if err != nil {
				return nil, err
			}
			return g.stop, nil
		})
	}
	if err != nil {
		d.undoGen(gen, prev)
		return nil, err
	}
	g.id = id
	d.setSocket(path)
	d.log.Debug("registration socket published", "socket", path, "endpoint", t.endpoint, "generation", gen)
	return g, nil
}

// serve serves the Registration service of generation gen on l, the listening socket at path
// (identity id), telling kubelet the endpoint of t and versions. With anyConn, the first
// verdict on any connection counts: kubelet asked GetInfo of another instance (a hand-over),
// and its verdict comes on a connection of its own. claim is the socket's descriptor claimed
// before it was created; nil for a socket already open (handed over), whose descriptor is
// counted, and never refused.
func (s *sockets) serve(l *net.UnixListener, path string, id fsid.ID, gen uint64, t target, versions []string, anyConn bool, claim *regserver.Claim) (*generation, error) {
	d := s.d
	srv, err := regserver.Serve(s.env.hub, l, path, regserver.Service{
		Gen: gen,
		Info: &registerapi.PluginInfo{
			Type:              d.spec.Type,
			Name:              d.spec.Name,
			Endpoint:          t.endpoint,
			SupportedVersions: versions,
		},
		Notify: d.notify,
		OnInfo: func(agent string) {
			d.log.Debug("kubelet called GetInfo", "generation", gen, "userAgent", agent)
		},
		OnLate: func() {
			d.log.Debug("verdict on a connection that never asked this socket's GetInfo ignored: it is about an older socket", "generation", gen)
		},
		AnyConn: anyConn,
	}, claim)
	if err != nil {
		return nil, err
	}
	return &generation{srv: srv, l: l, gen: gen, path: path, id: id, at: t, vers: versions}, nil
}

// checkGuard runs the guard, if any.
func (s *sockets) checkGuard() error {
	if s.env.guard == nil {
		return nil
	}
	return s.env.guard()
}

// withdraw stops a generation and removes its socket, so that kubelet deregisters it. held
// says whether kubelet may hold its registration, and so its path for a moment after
// (markWithdrawn): not a socket it rejected (its failed registration is no longer in its actual
// state from 1.36, and held nothing in its handler before), whose next socket may follow at
// once.
func (s *sockets) withdraw(g *generation, held bool) {
	g.stop()
	removed, err := sockfile.RemoveIfOurs(g.path, g.id)
	if err != nil {
		s.d.log.Warn("remove registration socket", "socket", g.path, "err", err)
	}
	if removed && held {
		s.markWithdrawn(g.path)
	}
}

// withdrawStale removes a socket at path that no one serves (see sockfile.RemoveStale): one an
// earlier run of multireg left. It logs why it could not.
func (s *sockets) withdrawStale(path string) {
	if err := sockfile.RemoveStale(path); err != nil {
		s.d.log.Warn("remove stale registration socket", "socket", path, "err", err)
	}
}

// replaced looks at g's socket after a wake-up (ev) and reports whether another file, or none,
// is at its path.
func (s *sockets) replaced(ev fswatch.Change, g *generation) bool {
	if ev&fswatch.DirGone != 0 {
		s.d.log.Warn("registration directory removed or moved", "dir", filepath.Dir(g.path))
	}
	id, _, err := fsid.Stat(g.path)
	return err != nil || id != g.id
}

// publishPath is where the next generation is published, for a loop that serves cur and whose
// rollover, if any, keeps prev: over cur, which it replaces, or for a device plugin with
// several sockets in another one (swaps); for a rollover, in a path prev does not hold, so
// that kubelet keeps a registration until the new one is made. Otherwise a driver that rolls
// over (rolls) publishes over a socket an earlier run of multireg left, keeping one: the
// first of the paths where a socket is, the others' withdrawn (kubelet still holds the
// first's meanwhile). A DRA driver outside a rollover publishes where clearPaths says instead
// (withdrawsFirst).
func (s *sockets) publishPath(cur, prev *generation, swaps, rolls bool) string {
	spec := s.d.spec
	switch {
	case cur != nil && swaps:
		return s.freePath(cur.path)
	case cur != nil:
		return cur.path
	case !rolls:
		return spec.SocketPath
	case prev != nil:
		return s.freePath(prev.path)
	}
	paths := spec.SocketPaths()
	keep := slices.IndexFunc(paths, func(p string) bool {
		_, _, err := fsid.Stat(p)
		return err == nil
	})
	if keep < 0 {
		return spec.SocketPath
	}
	for _, p := range paths[keep+1:] {
		if _, _, err := fsid.Stat(p); err == nil {
			s.withdrawStale(p)
		}
	}
	return paths[keep]
}

// freePath is the path to register in beside, or in place of, the registration at held: the
// first of the driver's other paths that kubelet does not hold, as far as multireg knows (no
// socket of its own withdrawn from there within settling), and that nothing else is in
// (inTheWay). A device plugin's third path is there for when kubelet may hold both others;
// with none free, the other of two. The status says which paths are in the way.
func (s *sockets) freePath(held string) string {
	var blocked []string
	defer func() { s.d.setInTheWay(blocked) }()
	for _, p := range s.d.spec.SocketPaths() {
		if p == held || time.Since(s.withdrawnAt[p]) < settling {
			continue
		}
		if why := inTheWay(p); why != "" {
			blocked = append(blocked, p)
			s.d.log.Warn("a registration path is in the way; the registration goes to another", "socket", p, "what", why)
			continue
		}
		return p
	}
	return s.otherPath(held)
}

// inTheWay says what, other than nothing or a socket no one accepts on (one an earlier run
// left), is at a registration path that multireg does not serve: a file, or a socket another
// process listens on, which kubelet would dial (for 10 s when it does not answer). "" for none.
func inTheWay(path string) string {
	_, mode, err := fsid.Stat(path)
	switch {
	case err != nil:
		return ""
	case mode != fs.ModeSocket:
		return (&sockfile.NotSocketError{Path: path, Mode: mode}).Error()
	}
	c, err := net.DialTimeout("unix", path, 100*time.Millisecond)
	if err != nil {
		return "" // no one listens: stale, replaced when published
	}
	c.Close()
	return path + " is a socket another process listens on"
}

// otherPath is the registration socket path of a rolling-over driver that is not path.
func (s *sockets) otherPath(path string) string {
	spec := s.d.spec
	if path == spec.SocketPath {
		return spec.AltSocketPath
	}
	return spec.SocketPath
}

// clearPaths withdraws the sockets at the driver's paths that kubelet may hold (an earlier
// run's, or one this run lost track of), and returns where to publish the next generation and
// from when: the first path from which no socket was withdrawn within settling, or the one
// that settles first. A driver with one path publishes there again once kubelet has let go of
// it; one with two (an endpoint pattern) at once in the other. A socket another process
// serves, or a file that is not a socket, is left alone, and its path returned: the
// publication there fails and waits until it is gone, as for any driver
// (sockfile.ServedError, sockfile.NotSocketError).
func (s *sockets) clearPaths() publication {
	paths := s.d.spec.SocketPaths()
	for _, p := range paths {
		id, mode, err := fsid.Stat(p)
		if err != nil {
			continue
		}
		if mode != fs.ModeSocket || sockfile.AnswersGetInfo(p) {
			return publication{path: p}
		}
		removed, err := sockfile.RemoveIfOurs(p, id)
		if err != nil {
			s.d.log.Warn("remove stale registration socket", "socket", p, "err", err)
		}
		if removed {
			s.markWithdrawn(p)
			s.d.log.Info("removed a registration socket kubelet may hold; the next one is published once kubelet cannot hold its path", "socket", p)
		}
	}
	next := paths[0]
	for _, p := range paths {
		if time.Since(s.withdrawnAt[p]) >= settling {
			return publication{path: p}
		}
		if s.withdrawnAt[p].Before(s.withdrawnAt[next]) {
			next = p
		}
	}
	return publication{path: next, at: s.withdrawnAt[next].Add(settling)}
}

// markWithdrawn records that a socket kubelet may hold left path just now (freePath,
// clearPaths), for a driver with several paths or a DRA driver.
func (s *sockets) markWithdrawn(path string) {
	spec := s.d.spec
	if spec.AltSocketPath == "" && spec.Type != config.DRAPlugin {
		return
	}
	if s.withdrawnAt == nil {
		s.withdrawnAt = map[string]time.Time{}
	}
	s.withdrawnAt[path] = time.Now()
}

// sleepBackoff waits for the rest of the backoff interval (wait) after the failure err (nil: a
// wait a hand-over gave the loop) and reports whether the wait ran its course (false: ctx
// ended it). When something that is not
// ours blocks a registration socket's path (err holds a sockfile.NotSocketError or a
// sockfile.ServedError), the wait also ends once it is gone: ws watches the path.
func (s *sockets) sleepBackoff(ctx context.Context, wait time.Duration, err error, ws watches, ep *endpoint) bool {
	if ns, blocked := errors.AsType[*sockfile.NotSocketError](err); blocked {
		return s.sleepBlocked(ctx, wait, ws.of(ns.Path), ns.Path, func() bool { return pathClear(ns.Path) })
	}
	if se, served := errors.AsType[*sockfile.ServedError](err); served {
		return s.sleepBlocked(ctx, wait, ws.of(se.Path), se.Path, func() bool { return sockfile.CheckNotServed(se.Path, fsid.ID{}) == nil })
	}
	// Whether the driver is on this node is kept up to date meanwhile: a driver removed from
	// the node while it backs off is absent at once, not after the backoff.
	_, ok := sleepUntil(ctx, wait, ws.ep, func(fswatch.Change) bool {
		ep.lookPresence()
		return false
	})
	return ok
}

// sleepBlocked waits for wait to pass or, watching a registration socket's path through sock,
// for the path to be clear (clear) of what blocked the socket: something multireg never
// removes. It reports false when ctx ends first.
func (s *sockets) sleepBlocked(ctx context.Context, wait time.Duration, sock *fswatch.Subscription, path string, clear func() bool) bool {
	sock.Take() // what happened before this look is seen by it
	if clear() {
		return true
	}
	woken, ok := sleepUntil(ctx, wait, sock, func(fswatch.Change) bool { return clear() })
	if woken {
		s.d.log.Info("registration socket path is clear; publishing the socket", "socket", path)
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

// rollsOver reports whether the loop rolls its registration over from one instance of its
// endpoint to the next through its second socket (config.Driver.RollsOver): a DRA driver's
// always, a device plugin's when its new instances are registered beside the old ones
// (devicemoves.go). A rollover under way (rolling) is finished the way it started.
func (s *sockets) rollsOver(rolling bool) bool {
	spec := s.d.spec
	return spec.AlwaysRollsOver() || spec.RollsOver() && (rolling || s.env.moves.beside())
}

// swapsPaths reports whether a device plugin with several registration sockets registers again
// in a path kubelet does not hold (freePath), the one it holds being withdrawn right after
// (the publish act): kubelet deregisters the one and registers the other in the same
// reconcile pass, deregistering first. Registered again in the same path, kubelet would
// deregister the old socket in one pass and register the new one only in the next (both are
// operations on one path, and one waits for the other), and its device manager holds no
// client for the resource meanwhile. Not while a rollover keeps a registration (rolling).
func (s *sockets) swapsPaths(rolling bool) bool {
	return s.d.spec.Type == config.DevicePlugin && s.d.spec.AltSocketPath != "" && !rolling
}

// withdrawsFirst reports whether the next generation is published only once every socket
// kubelet may hold for the driver is gone, and in a path kubelet holds no registration of
// (clearPaths): a DRA driver's, outside a rollover (rolling).
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
func (s *sockets) withdrawsFirst(rolling bool) bool {
	return s.d.spec.Type == config.DRAPlugin && !rolling
}
