package registrar

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
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
//   - a DRA driver's registration rolls over (rollover.go): the new instance is registered
//     through the second registration socket while the old one stays, and the old
//     registration is withdrawn once the new one is registered and the old instance is gone.
//     kubelet keeps both meanwhile and calls the newest, so it never holds none. A newer
//     instance is taken as soon as it answers, as the DRA kubeletplugin helper's rolling
//     update does.
//   - a device plugin's rolls over the same way while kubelet's pod-resources view shows
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

// fixedTarget is the target of a driver without a pattern.
func fixedTarget(spec config.Driver) target {
	return target{endpoint: spec.Endpoint, local: spec.LocalEndpoint}
}

// matches returns the sockets matching the driver's endpoint pattern, newest first.
func (ep *endpoint) matches() []match { return patternMatches(ep.d.spec, ep.d.log) }

// NewestMatch is the socket, as multireg dials it, that a loop of spec (a driver whose endpoint
// is a pattern) tries first: the newest match; "" when none matches. What a liveness check
// dials where no loop of the driver runs (a standby instance).
func NewestMatch(spec config.Driver) string {
	if ms := patternMatches(spec, slog.New(slog.DiscardHandler)); len(ms) > 0 {
		return ms[0].local
	}
	return ""
}

// patternMatches returns the sockets matching spec's endpoint pattern, newest first. Files
// that are not sockets, and sockets whose path kubelet cannot dial (logged at debug level),
// are left out.
func patternMatches(spec config.Driver, log *slog.Logger) []match {
	var ms []match
	for _, e := range fswatch.MatchingEntries(filepath.Dir(spec.LocalEndpoint), filepath.Base(spec.LocalEndpoint)) {
		if e.Type() != fs.ModeSocket {
			continue
		}
		endpoint, local := spec.Concrete(e.Name())
		if len(endpoint) > config.MaxSocketPathLen || len(local) > config.MaxSocketPathLen || !config.KubeletCanDial(endpoint) {
			log.Debug("a socket matching the endpoint pattern cannot be dialled; skipped", "socket", local)
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
// probe; for a pattern, the newest match that answers. It returns the identity of the file
// probed (the newest match when none answers; zero when there is none), the target to register
// (when one answers), the error of a look at the file (fs.ErrNotExist: the driver is absent)
// and the probe's error.
func (ep *endpoint) lookTarget(ctx context.Context) (fsid.ID, target, error, error) {
	spec := ep.d.spec
	if !spec.EndpointIsPattern() {
		id, _, statErr := fsid.Stat(ep.at.local)
		return id, ep.at, statErr, ep.probeAt(ctx, ep.at)
	}
	ms := ep.matches()
	if len(ms) == 0 {
		return fsid.ID{}, target{}, fs.ErrNotExist, fmt.Errorf("no socket matches endpoint %s", spec.LocalEndpoint)
	}
	if i := slices.IndexFunc(ms, func(m match) bool { return m.local == ep.at.local }); i > 0 && !spec.RollsOver() {
		// Stay with the target while it answers: a move costs a re-registration.
		ms[0], ms[i] = ms[i], ms[0]
	}
	var errs []error
	for _, m := range ms {
		err := ep.probeAt(ctx, m.target)
		if err == nil {
			return m.id, m.target, nil, nil
		}
		if ctx.Err() != nil {
			return fsid.ID{}, target{}, nil, ctx.Err()
		}
		// A match that answers under another name is another driver's: it is only not ours.
		if nm, ok := errors.AsType[*probe.NameMismatchError](err); ok {
			err = errors.New(nm.Error())
		}
		errs = append(errs, err)
	}
	return ms[0].id, target{}, nil, fmt.Errorf("no socket matching endpoint %s answers: %w", spec.LocalEndpoint, errors.Join(errs...))
}

// probeAt probes the driver's endpoint at t.
func (ep *endpoint) probeAt(ctx context.Context, t target) error {
	spec := ep.d.spec
	spec.Endpoint, spec.LocalEndpoint = t.endpoint, t.local
	return ep.env.inFlight.Do(ctx, func() error { return ep.env.probe(ctx, spec) })
}

// setTarget makes t the endpoint the loop registers, and the one its status shows.
func (ep *endpoint) setTarget(t target) {
	if t != ep.at {
		if ep.at != (target{}) {
			ep.d.log.Info("the endpoint pattern's newest answering socket is now "+t.local, "was", ep.at.local)
		}
		ep.at = t
	}
	ep.d.setEndpoint(t)
}

// present reports whether the driver's endpoint is on this node: its file, or for a pattern
// a matching socket.
func (ep *endpoint) present() error {
	if !ep.d.spec.EndpointIsPattern() {
		_, _, err := fsid.Stat(ep.at.local)
		return err
	}
	if len(ep.matches()) == 0 {
		return fs.ErrNotExist
	}
	return nil
}

// newer looks, after a wake-up of a pattern's subscription or at a recheck, at whether the
// target should change: a newer match answers and the driver rolls its registration over, or
// the target is gone or no longer answers while another match does. It returns the match the
// loop would move to ("" if none; the next lookTarget picks the new target), and whether
// matches other than the target are there, which the loop looks at again later: one may not
// answer yet, or the target may stop answering without its file going. It also records the
// endpoint's presence.
func (ep *endpoint) newer(ctx context.Context) (to string, others bool) {
	ms := ep.matches()
	ep.d.setPresence(errIfEmpty(len(ms)))
	cur := slices.IndexFunc(ms, func(m match) bool { return m.local == ep.at.local })
	others = len(ms) > 1 || len(ms) == 1 && cur < 0
	if !others {
		return "", false // the target alone, or its restart (change sees that)
	}
	// A driver with several registration sockets takes a newer instance as soon as it
	// answers: it rolls over to it, or registers it in place of the old one's registration
	// (swapsPaths), which costs kubelet no reconcile pass.
	rolls := ep.d.spec.RollsOver()
	if cur >= 0 && !rolls && ep.probeAt(ctx, ms[cur].target) == nil {
		return "", true // stay with the target while it answers: a move costs a re-registration
	}
	// Newest first: a driver with several sockets takes a newer instance as soon as it
	// answers; otherwise the target is gone or does not answer, and the newest match that
	// answers takes over.
	for _, m := range ms {
		if m.local == ep.at.local {
			if rolls && ep.probeAt(ctx, m.target) == nil {
				return "", true
			}
			continue
		}
		if ep.probeAt(ctx, m.target) == nil {
			return m.local, true
		}
	}
	return "", true
}

// gone reports whether the driver's endpoint at t is gone: no file, or no answer.
func (ep *endpoint) gone(ctx context.Context, t target) bool {
	if _, _, err := fsid.Stat(t.local); err != nil {
		return true
	}
	return ep.probeAt(ctx, t) != nil
}

func errIfEmpty(n int) error {
	if n == 0 {
		return fs.ErrNotExist
	}
	return nil
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

// watches are a loop's subscriptions: its registration socket's, the second one's of a
// driver that rolls over and the third one's of a device plugin that has it (nil for others),
// and its endpoint's (every match of a pattern).
type watches struct {
	sock, alt, spare, ep *fswatch.Subscription
}

func subscribe(w *fswatch.Watcher, spec config.Driver) watches {
	ws := watches{sock: w.Subscribe(spec.SocketPath)}
	if spec.AltSocketPath != "" {
		ws.alt = w.Subscribe(spec.AltSocketPath)
	}
	if spec.SparePath != "" {
		ws.spare = w.Subscribe(spec.SparePath)
	}
	if spec.EndpointIsPattern() {
		ws.ep = w.SubscribeMatching(spec.LocalEndpoint)
	} else {
		ws.ep = w.Subscribe(spec.LocalEndpoint)
	}
	return ws
}

// of returns the subscription of a registration socket's path.
func (ws watches) of(path string) *fswatch.Subscription {
	if ws.alt != nil && ws.alt.Path() == path {
		return ws.alt
	}
	if ws.spare != nil && ws.spare.Path() == path {
		return ws.spare
	}
	return ws.sock
}

func (ws watches) close() {
	for _, s := range []*fswatch.Subscription{ws.sock, ws.alt, ws.spare, ws.ep} {
		if s != nil {
			s.Close()
		}
	}
}
