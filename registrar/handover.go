package registrar

import (
	"context"
	"fmt"
	"math"
	"net"
	"os"
	"path/filepath"
	"slices"
	"time"

	csi "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/proto"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/handover"
	"multireg.dev/multireg/internal/regserver"
)

// A hand-over, as a driver's loop takes part in it (internal/handover carries it between
// processes, and Supervisor.move within one): the loop that ends hands over its sockets,
// listening, and what it knows (handOverState, the HandOver row); the loop that goes on takes
// them over (takeOver: the sockets are served at once; startFrom: the loop starts from
// them, TakingOver), and decides what becomes of them once the endpoint answers (the act
// takeOverDecides, TakingOver's EndpointUp row).

// takeover is what a loop starts from after a hand-over: what the other instance handed over,
// its sockets already served here.
type takeover struct {
	cur         *generation // the socket handed over, served already; nil when there was none
	prev        *generation // a rollover's previous socket, served already; nil when none
	epID        fsid.ID     // the endpoint's socket as the other instance last probed it
	nextAttempt time.Time   // a backing-off driver's next attempt
	phase       Phase       // the phase the other instance showed
	at          target      // the endpoint it registered (a pattern's match), as this process reaches it
	nodeInfo    *csi.NodeGetInfoResponse
	// versions are those cur's GetInfo answers; timeout and failures the pacing's.
	versions []string
	timeout  time.Duration
	failures int
}

// handOverState stops the loop's generations for a hand-over and returns what the next loop
// needs: a copy of each listening socket, and the loop's state. The sockets stay, listening:
// the kernel queues kubelet's connections until the next loop accepts them. A socket that
// cannot be copied is left as it is, and the next loop publishes its own over it. A verdict
// that came as the loop stopped is taken as the loop would have (lateVerdict).
func (l *loop) handOverState() *handover.Driver {
	// A copy of each listening socket first: it keeps the socket open when the server closes
	// its own. Then the servers stop: no verdict comes after that.
	prev, cur := l.ro.generation(), l.cur
	files := map[*generation]*os.File{}
	for _, g := range []*generation{prev, cur} {
		if g == nil {
			continue
		}
		f, err := g.l.File()
		g.stop()
		if err != nil {
			l.log.Warn("cannot hand over the registration socket; the next instance publishes its own", "socket", g.path, "err", err)
			continue
		}
		files[g] = f
	}
	if cur != nil {
		if v := l.d.takeVerdict(cur); v != nil && !l.lateVerdict(cur, v) {
			if f := files[cur]; f != nil {
				f.Close()
			}
			delete(files, cur)
		}
	}
	h := &handover.Driver{
		Spec:          l.d.spec,
		Endpoint:      l.ep.at.endpoint,
		LocalEndpoint: l.ep.at.local,
		EndpointID:    l.ep.probed,
		Status:        handedStatus(l.d.status()),
		Timeout:       l.p.timeout,
		Failures:      l.p.failures,
	}
	if l.ep.nodeInfo != nil {
		h.NodeInfo, _ = proto.Marshal(l.ep.nodeInfo)
	}
	for _, g := range []*generation{prev, cur} {
		f := files[g]
		if g == nil || f == nil {
			continue
		}
		h.Sockets = append(h.Sockets, &handover.Socket{
			Prev:          g == prev,
			Path:          g.path,
			ID:            g.id,
			Generation:    g.gen,
			Registered:    g.registered,
			AwaitsVerdict: !g.registered && g.awaiting(),
			Endpoint:      g.at.endpoint,
			LocalEndpoint: g.at.local,
			Versions:      g.vers,
			File:          f,
			Own:           true,
		})
	}
	l.ro = nil
	return h
}

// lateVerdict takes a verdict on g that came as the loop stopped for a hand-over, as the loop
// would have (accepted, rejected): a registration is recorded (and a CSI driver's NodeGetInfo
// with it); a rejection withdraws g and plans the next attempt after the backoff, which the
// status hands over. It reports whether g is left to hand over.
func (l *loop) lateVerdict(g *generation, v *regserver.Verdict) bool {
	if v.Registered {
		l.registered(context.WithoutCancel(l.ctx), g) // the loop's context has ended; the call has its own timeout
		return true
	}
	l.d.record(outRejected)
	l.socks.withdraw(g, false)
	l.backOff(v.Rejection()) // shows BackingOff (Registered while a rollover keeps the previous registration)
	return false
}

// handedStatus is st as a hand-over carries it: what the next loop goes on from. Its name,
// type, endpoint, required and what it displays are the receiver's configuration's, and
// kubelet's view is read anew.
func handedStatus(st DriverStatus) handover.Status {
	return handover.Status{
		Phase:            string(st.Phase),
		Socket:           st.Socket,
		EndpointUp:       st.EndpointUp,
		Absent:           st.Absent,
		Attempts:         st.Attempts,
		Failures:         st.Failures,
		Results:          st.Results,
		Recreations:      st.Recreations,
		EndpointRestarts: st.EndpointRestarts,
		HeldByOther:      st.HeldByOther,
		LastError:        st.LastError,
		Since:            st.Since,
		NextAttempt:      st.NextAttempt,
	}
}

// takenStatus is the status of d's loop going on from hs, as handedStatus carried it: what hs
// does not say is d's own (its name, type, endpoint, required and display), or a fresh loop's.
func (d *driver) takenStatus(hs handover.Status) DriverStatus {
	st := DriverStatus{
		Name:             d.spec.Name,
		Type:             d.spec.Type,
		Display:          d.spec.Display,
		Endpoint:         d.spec.Endpoint,
		Required:         d.spec.Required,
		Phase:            Phase(hs.Phase),
		Socket:           hs.Socket,
		EndpointUp:       hs.EndpointUp,
		Absent:           hs.Absent,
		Attempts:         hs.Attempts,
		Failures:         hs.Failures,
		Results:          hs.Results,
		Recreations:      hs.Recreations,
		EndpointRestarts: hs.EndpointRestarts,
		HeldByOther:      hs.HeldByOther,
		LastError:        hs.LastError,
		Since:            hs.Since,
		NextAttempt:      hs.NextAttempt,
	}
	if st.Socket == "" {
		st.Socket = d.spec.SocketPath
	}
	if st.Results == nil {
		st.Results = map[string]int{}
	}
	if st.Recreations == nil {
		st.Recreations = map[string]int{}
	}
	if st.Since.IsZero() {
		st.Since = time.Now()
	}
	return st
}

// takeOver makes d, before its loop runs, go on from h: it serves h's sockets at once (socks,
// of the loop to come), and takes the status; the loop takes the rest when it starts (the
// takeover returned: startFrom). A socket that is no longer the file at its path, or not a
// listening socket, is closed: the loop publishes anew. It returns how many sockets it serves.
func (d *driver) takeOver(h *handover.Driver, socks *sockets) (*takeover, int) {
	n := 0
	a := &takeover{
		epID: h.EndpointID, nodeInfo: handedNodeInfo(h), timeout: h.Timeout, failures: h.Failures,
		at: handedTarget(d.spec, h.Endpoint),
	}
	st := d.takenStatus(h.Status)
	// The newest handed generation is current before any socket is served: a verdict queued on
	// one during the hand-over is read as soon as it is, and must not be taken for an older
	// socket's.
	d.mu.Lock()
	for _, hs := range h.Sockets {
		d.gen = max(d.gen, hs.Generation)
	}
	d.lastGen = d.gen
	d.mu.Unlock()
	for _, hs := range h.Sockets {
		g, err := d.takeSocket(hs, socks)
		if err != nil {
			d.log.Warn("a handed-over registration socket cannot be served; publishing anew", "socket", hs.Path, "err", err)
			continue
		}
		n++
		if hs.Prev {
			a.prev = g
		} else {
			a.cur, a.versions = g, hs.Versions
		}
	}
	switch {
	case a.cur == nil && a.prev == nil && st.Phase != BackingOff:
		st.Phase, st.Since = WaitingForEndpoint, time.Now()
	case a.cur == nil && st.Phase == BackingOff && st.NextAttempt.After(time.Now()):
		st.NextAttempt = d.boundedAttempt(st.NextAttempt)
		a.nextAttempt = st.NextAttempt
	case !slices.Contains(Phases, st.Phase): // the predecessor did not say: the sockets do
		st.Phase, st.Since = Serving, time.Now()
		if a.cur != nil && a.cur.registered {
			st.Phase = Registered
		}
	}
	a.phase = st.Phase
	d.mu.Lock()
	d.st = st
	d.mu.Unlock()
	d.changes.notify()
	return a, n
}

// startFrom makes the loop, as it starts, go on from what a hand-over gave it: TakingOver
// with the sockets it handed, BackingOff until the next attempt the other instance had
// planned, or WaitingForEndpoint.
func (l *loop) startFrom(a *takeover) {
	if l.d.spec.EndpointIsPattern() {
		l.ep.at = a.at
		l.d.setEndpoint(a.at)
	}
	l.ep.nodeInfo, l.ep.probed = a.nodeInfo, a.epID
	l.p.takeOver(a.timeout, a.failures)
	if a.prev != nil {
		l.ro = &rollover{prev: a.prev}
	}
	if a.cur != nil {
		l.ep.handedHealth(a.versions, a.epID)
	}
	switch {
	case a.cur != nil:
		l.st, l.cur, l.a = stTakingOver, a.cur, a
	case !a.nextAttempt.IsZero():
		// A backing-off driver: it waits until the next attempt the other instance had
		// planned.
		l.st, l.retryIn, l.retryAt = stBackingOff, time.Until(a.nextAttempt), a.nextAttempt
	}
}

// boundedAttempt is the next attempt a predecessor planned, no later than the longest wait
// this driver's backoff allows from now (its maxInterval, randomized up).
func (d *driver) boundedAttempt(at time.Time) time.Time {
	b := d.spec.Backoff
	f := float64(b.MaxInterval) * (1 + b.RandomizationFactor)
	if f >= math.MaxInt64/2 { // centuries
		return at
	}
	if limit := time.Now().Add(time.Duration(f)); at.After(limit) {
		d.log.Warn("the next attempt handed over is later than this driver's backoff allows; trying sooner",
			"handed", at.Format(time.RFC3339), "nextAttempt", limit.Format(time.RFC3339), "maxInterval", b.MaxInterval)
		return limit
	}
	return at
}

// handedTarget is the target another instance handed over as endpoint, what kubelet dials, as
// this process reaches it: where spec's localEndpoint says. The other instance's own
// localEndpoint is its own (config.Local): kubelet sees nothing of it, and this process may
// reach the same socket by another path.
func handedTarget(spec config.Driver, endpoint string) target {
	if spec.EndpointIsPattern() && endpoint == "" {
		return target{} // no match was registered
	}
	endpoint, local := spec.Concrete(filepath.Base(endpoint))
	return target{endpoint: endpoint, local: local}
}

// handedNodeInfo decodes the NodeGetInfo answer h recorded; nil when none.
func handedNodeInfo(h *handover.Driver) *csi.NodeGetInfoResponse {
	if len(h.NodeInfo) == 0 {
		return nil
	}
	var r csi.NodeGetInfoResponse
	if proto.Unmarshal(h.NodeInfo, &r) != nil {
		return nil
	}
	return &r
}

// takeSocket serves a handed-over socket as a generation of d's loop.
func (d *driver) takeSocket(hs *handover.Socket, socks *sockets) (*generation, error) {
	err := hs.Check()
	f := hs.File
	hs.File = nil
	if f == nil {
		return nil, err
	}
	defer f.Close() // FileListener keeps a copy
	if err != nil {
		return nil, err
	}
	if !slices.Contains(d.spec.SocketPaths(), hs.Path) {
		return nil, fmt.Errorf("not a registration socket path of this configuration")
	}
	ln, err := net.FileListener(f)
	if err != nil {
		return nil, err
	}
	l, ok := ln.(*net.UnixListener)
	if !ok {
		ln.Close()
		return nil, fmt.Errorf("not a unix socket")
	}
	l.SetUnlinkOnClose(false)
	versions := hs.Versions
	if versions == nil { // a predecessor that did not say: it advertised the configured ones
		versions = d.spec.SupportedVersions
	}
	g, err := socks.serve(l, hs.Path, hs.ID, hs.Generation, handedTarget(d.spec, hs.Endpoint), versions, hs.AwaitsVerdict, nil)
	if err != nil {
		l.Close()
		return nil, err
	}
	g.registered = hs.Registered
	return g, nil
}

// takeOverDecides is TakingOver's act once the endpoint answers: what becomes of the socket a
// hand-over gave the loop (cur), from what the other instance told (l.a): kubelet's verdict
// on an unregistered one is awaited, and a registered one kept, while the endpoint is the one
// the other instance last probed; a driver restarted meanwhile is decided as after any
// restart (restart.go); a newer instance of the endpoint is rolled over to. Otherwise the loop
// publishes anew.
func takeOverDecides(l *loop, e event) state {
	cur, a, up := l.cur, l.a, e.up
	l.ep.takeUp(up)
	l.probeB.Reset()
	same := !l.d.spec.WaitForEndpoint || a.epID == (fsid.ID{}) || up.id == a.epID
	next := stPublishing
	switch {
	case !cur.registered && same:
		if cur.at == l.ep.at {
			next = stAwaitingVerdict // kubelet owes it a verdict: awaited, with the registration timeout
		}
	case !cur.registered:
		l.ep.countReregistration("why", "the driver restarted during the hand-over")
	case cur.at != l.ep.at: // a newer instance of the endpoint answers
		if l.socks.rollsOver(l.ro != nil) && l.ro == nil {
			l.startRollover(cur)
			l.cur = nil
		}
	case same:
		next = stRegistered
	case l.ep.keepsOnRestart(cur):
		keeps, decided := l.ep.keepsRegistration(l.ctx, cur)
		if !decided {
			return stTakingOver
		}
		if keeps {
			next = stRegistered
		}
	default:
		l.ep.countReregistration("why", "the driver restarted during the hand-over")
	}
	l.ep.probed, l.ep.probedAt, l.a = up.id, up.probedAt, nil
	if next == stPublishing {
		return l.publishing()
	}
	return next
}
