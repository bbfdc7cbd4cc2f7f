package registrar

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"slices"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/fswatch"
	"multireg.dev/multireg/internal/probe"
)

// A driver whose endpoint's last element is a pattern (config.Driver.EndpointIsPattern) starts
// under a new socket name each time: a DRA driver in rolling-update mode ("dra-<pod uid>.sock"),
// a device plugin named by its start time ("dp.<unix time>"). Its loop registers one match at
// a time, its target: the newest matching socket that answers. kubelet is told the target's
// path, never the pattern. When the target goes (its file removed, or it no longer answers
// while another match does), the loop moves to the newest match that answers:
//   - a DRA driver's registration is handed over: the new instance is registered through the
//     second registration socket while the old one stays, and the old registration is
//     withdrawn once the new one is registered and the old instance is gone. kubelet keeps
//     both meanwhile and calls the newest, so it never holds none. A newer instance is taken
//     as soon as it answers, as the DRA kubeletplugin helper's rolling update does.
//   - a device plugin's is handed over the same way while kubelet's pod-resources view shows
//     that kubelet keeps several endpoints of one resource (1.37 and later: devicemoves.go):
//     kubelet promotes the new endpoint when the old one goes, and the resource's devices
//     never leave the node's allocatable. What kubelet did is read back, and repaired.
//   - a CSI driver, or a device plugin on an older kubelet, is registered again under the new
//     path: kubelet holds one registration per name, and unregisters the plugin for a
//     reconcile pass (about a second). (An older device manager disconnects whichever client
//     it holds when either instance goes: a new instance registered beside a running one
//     would be dropped when the old one exits.) The loop stays with its target while it
//     answers, so that a second instance never costs a re-registration before the first one
//     is gone.

// target is the endpoint a loop registers: the configured one, or the match of its pattern
// the loop chose.
type target struct {
	endpoint string // what kubelet dials, given in GetInfo
	local    string // what multireg dials
}

// match is a socket that matches a driver's endpoint pattern.
type match struct {
	target
	id  fsid.ID
	mod int64 // modification time, ns: when the socket was bound
}

// handover reports whether the loop hands its registration from one instance of its endpoint
// to the next through its second socket (config.Driver.Handover): a DRA driver's always, a
// device plugin's when its new instances are registered beside the old ones (devicemoves.go).
// A move under way is finished the way it started.
func (d *driver) handover() bool {
	return d.spec.AlwaysRollsOver() || d.spec.RollsOver() && (d.prev != nil || d.moves.beside())
}

// fixedTarget is the target of a driver without a pattern.
func fixedTarget(spec config.Driver) target {
	return target{endpoint: spec.Endpoint, local: spec.LocalEndpoint}
}

// matches returns the sockets matching the driver's endpoint pattern, newest first. Files
// that are not sockets, and sockets whose path kubelet cannot dial, are left out.
func (d *driver) matches() []match {
	var ms []match
	for _, e := range fswatch.MatchingEntries(filepath.Dir(d.spec.LocalEndpoint), filepath.Base(d.spec.LocalEndpoint)) {
		if e.Type() != fs.ModeSocket {
			continue
		}
		endpoint, local := d.spec.Concrete(e.Name())
		if len(endpoint) > config.MaxSocketPathLen || len(local) > config.MaxSocketPathLen || !config.KubeletCanDial(endpoint) {
			d.log.Debug("a socket matching the endpoint pattern cannot be dialled; skipped", "socket", local)
			continue
		}
		info, err := e.Info() // one lstat: the identity and the bind time
		if err != nil {
			continue // gone since
		}
		id, err := fsid.Of(local, info)
		if err != nil {
			continue
		}
		ms = append(ms, match{target: target{endpoint: endpoint, local: local}, id: id, mod: info.ModTime().UnixNano()})
	}
	slices.SortFunc(ms, func(a, b match) int {
		return cmp.Or(cmp.Compare(b.mod, a.mod), cmp.Compare(b.local, a.local))
	})
	return ms
}

// lookTarget is one look for the endpoint to register: for a fixed endpoint, its file and a
// probe; for a pattern, the newest match that answers, which becomes the loop's target. It
// returns the identity of the file probed (the newest match when none answers; zero when there
// is none), the error of a look at the file (fs.ErrNotExist: the driver is absent) and the
// probe's error.
func (d *driver) lookTarget(ctx context.Context) (fsid.ID, error, error) {
	if !d.spec.EndpointIsPattern() {
		id, _, statErr := fsid.Stat(d.at.local)
		return id, statErr, d.probeAt(ctx, d.at)
	}
	ms := d.matches()
	if len(ms) == 0 {
		return fsid.ID{}, fs.ErrNotExist, fmt.Errorf("no socket matches endpoint %s", d.spec.LocalEndpoint)
	}
	if i := slices.IndexFunc(ms, func(m match) bool { return m.local == d.at.local }); i > 0 && !d.handover() {
		// Stay with the target while it answers: a move costs a re-registration.
		ms[0], ms[i] = ms[i], ms[0]
	}
	var errs []error
	for _, m := range ms {
		err := d.probeAt(ctx, m.target)
		if err == nil {
			d.setTarget(m.target)
			return m.id, nil, nil
		}
		if ctx.Err() != nil {
			return fsid.ID{}, nil, ctx.Err()
		}
		// A match that answers under another name is another driver's: it is only not ours.
		if nm, ok := errors.AsType[*probe.NameMismatchError](err); ok {
			err = errors.New(nm.Error())
		}
		errs = append(errs, err)
	}
	return ms[0].id, nil, fmt.Errorf("no socket matching endpoint %s answers: %w", d.spec.LocalEndpoint, errors.Join(errs...))
}

// probeAt probes the driver's endpoint at t.
func (d *driver) probeAt(ctx context.Context, t target) error {
	spec := d.spec
	spec.Endpoint, spec.LocalEndpoint = t.endpoint, t.local
	return d.slots.Do(ctx, func() error { return d.probe(ctx, spec) })
}

// setTarget makes t the endpoint the loop registers, and the one its status shows.
func (d *driver) setTarget(t target) {
	if t != d.at {
		if d.at != (target{}) {
			d.log.Info("the endpoint pattern's newest answering socket is now "+t.local, "was", d.at.local)
		}
		d.at = t
	}
	d.mu.Lock()
	d.st.Endpoint = t.endpoint
	d.mu.Unlock()
}

// present reports whether the driver's endpoint is on this node: its file, or for a pattern
// a matching socket.
func (d *driver) present() error {
	if !d.spec.EndpointIsPattern() {
		_, _, err := fsid.Stat(d.at.local)
		return err
	}
	if len(d.matches()) == 0 {
		return fs.ErrNotExist
	}
	return nil
}

// moved looks, after a wake-up of a pattern's subscription or at a recheck, at whether the
// target should change: a newer match answers and the driver hands its registration over, or
// the target is gone or no longer answers while another match does. It returns the match the
// loop would move to ("" if none; the next lookTarget picks the new target), and whether
// matches other than the target are there, which the loop looks at again later: one may not
// answer yet, or the target may stop answering without its file going. It also records the
// endpoint's presence.
func (d *driver) moved(ctx context.Context) (to string, others bool) {
	ms := d.matches()
	d.setPresence(errIfEmpty(len(ms)))
	cur := slices.IndexFunc(ms, func(m match) bool { return m.local == d.at.local })
	others = len(ms) > 1 || len(ms) == 1 && cur < 0
	if !others {
		return "", false // the target alone, or its restart (endpointRestarted sees that)
	}
	handover := d.handover()
	if cur >= 0 && !handover && d.probeAt(ctx, ms[cur].target) == nil {
		return "", true // stay with the target while it answers: a move costs a re-registration
	}
	// Newest first: a handover takes a newer instance as soon as it answers; otherwise the
	// target is gone or does not answer, and the newest match that answers takes over.
	for _, m := range ms {
		if m.local == d.at.local {
			if handover && d.probeAt(ctx, m.target) == nil {
				return "", true
			}
			continue
		}
		if d.probeAt(ctx, m.target) == nil {
			return m.local, true
		}
	}
	return "", true
}

// gone reports whether the driver's endpoint at t is gone: no file, or no answer.
func (d *driver) gone(ctx context.Context, t target) bool {
	if _, _, err := fsid.Stat(t.local); err != nil {
		return true
	}
	return d.probeAt(ctx, t) != nil
}

func errIfEmpty(n int) error {
	if n == 0 {
		return fs.ErrNotExist
	}
	return nil
}

// slot is where the next socket is published: over the current generation's socket, which it
// replaces; for a handover, in the path the previous generation does not hold, so that kubelet
// keeps a registration until the new one is made. Otherwise a handover driver publishes over a
// socket an earlier run of multireg left (kubelet may hold it, for the very endpoint to register,
// and refuses a second registration of one endpoint), keeping one of two: the second path's is
// removed when both are there (kubelet still holds the first's meanwhile).
func (d *driver) slot(cur *generation) string {
	switch {
	case cur != nil:
		return cur.path
	case !d.handover():
		return d.spec.SocketPath
	case d.prev != nil:
		return d.other(d.prev.path)
	}
	_, _, primary := fsid.Stat(d.spec.SocketPath)
	_, _, alt := fsid.Stat(d.spec.AltSocketPath)
	switch {
	case primary != nil && alt == nil:
		return d.spec.AltSocketPath
	case primary == nil && alt == nil:
		d.removeStale(d.spec.AltSocketPath)
	}
	return d.spec.SocketPath
}

// resume makes the previous generation of a handover the current one again, and returns it:
// kubelet holds its registration. Its verdicts count again (kubelet asks anew when it
// restarts), and a verdict still pending for the generation left is dropped.
func (d *driver) resume() *generation {
	g := d.prev
	d.prev = nil
	d.makeCurrent(g)
	d.setSocket(g.path)
	d.log.Info("back to the registration kubelet holds", "socket", g.path, "endpoint", g.at.local)
	return g
}

// other is the registration socket path of a handover driver that is not path.
func (d *driver) other(path string) string {
	if path == d.spec.SocketPath {
		return d.spec.AltSocketPath
	}
	return d.spec.SocketPath
}

// settleHandover withdraws what a handover driver's registration no longer needs, once kubelet
// has registered g: the previous generation when its endpoint is gone, and a socket an earlier
// run left in the other path that no one serves.
func (d *driver) settleHandover(ctx context.Context, g *generation) {
	if ctx.Err() != nil {
		return // no look can tell whether the old instance is gone
	}
	if d.prev == nil {
		if d.spec.AltSocketPath != "" {
			d.removeStale(d.other(g.path))
		}
		return
	}
	if d.gone(ctx, d.prev.at) {
		d.log.Info("the new instance is registered and the old one is gone; withdrawing the old registration",
			"socket", d.prev.path, "endpoint", d.prev.at.local)
		d.retire(d.prev)
		d.prev = nil
		d.withdrawn(g)
	}
}

// Rechecks of other sockets matching an endpoint pattern: 50ms, 100ms, … then every 5s.
const recheckMax = 5 * time.Second

// nextRecheck is the wait before the next recheck: none without other matches, quick again
// after a wake-up (woken), doubling up to recheckMax otherwise.
func nextRecheck(last time.Duration, woken, others bool) time.Duration {
	switch {
	case !others:
		return 0
	case woken || last == 0:
		return quickProbeMin
	}
	return min(2*last, recheckMax)
}

// socketsGone looks at g's socket after a wake-up (ev) and reports whether another file, or
// none, is at its path. The previous generation of a handover, if its socket went, is stopped:
// kubelet has withdrawn it, and the new one is being registered.
func (d *driver) socketsGone(ev fswatch.Change, g *generation) bool {
	if d.prev != nil && d.socketGone(0, d.prev) {
		d.log.Info("the old instance's registration socket was removed", "socket", d.prev.path)
		d.prev.stop()
		d.prev = nil
		if g.registered {
			d.withdrawn(g)
		}
		if !g.registered { // kubelet holds none of ours now
			d.update(Serving, "", time.Time{})
		}
	}
	return d.socketGone(ev, g)
}

// watches are a loop's subscriptions: its registration socket's, the second one's of a
// handover driver (nil for others), and its endpoint's (every match of a pattern).
type watches struct {
	sock, alt, ep *fswatch.Subscription
}

func (d *driver) subscribe() watches {
	ws := watches{sock: d.w.Subscribe(d.spec.SocketPath)}
	if d.spec.AltSocketPath != "" {
		ws.alt = d.w.Subscribe(d.spec.AltSocketPath)
	}
	if d.spec.EndpointIsPattern() {
		ws.ep = d.w.SubscribeMatching(d.spec.LocalEndpoint)
	} else {
		ws.ep = d.w.Subscribe(d.spec.LocalEndpoint)
	}
	return ws
}

// of returns the subscription of a registration socket's path.
func (ws watches) of(path string) *fswatch.Subscription {
	if ws.alt != nil && ws.alt.Path() == path {
		return ws.alt
	}
	return ws.sock
}

func (ws watches) close() {
	for _, s := range []*fswatch.Subscription{ws.sock, ws.alt, ws.ep} {
		if s != nil {
			s.Close()
		}
	}
}
