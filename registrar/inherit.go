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

// How a loop hands its sockets and state to another instance, and how a loop starts from what
// it was handed (internal/handover carries them between processes): a hand-over gives the loop
// its starting state (newLoop) and, for the sockets handed, what decides them once the
// endpoint answers (takeOver).

// adoption is what a loop starts from after a hand-over.
type adoption struct {
	cur         *generation // the socket handed over, served already; nil when there was none
	epID        fsid.ID     // the endpoint's socket as the other instance last probed it
	nextAttempt time.Time   // a backing-off driver's next attempt
}

// detach stops the loop's generations for a hand-over and returns what the next instance
// needs: a copy of each listening socket, and the loop's state. The sockets stay, listening:
// the kernel queues kubelet's connections until the next instance accepts them. A socket that
// cannot be copied is left as it is, and the next instance publishes its own over it.
func (d *driver) detach(cur *generation) *handover.Driver {
	// A copy of each listening socket first: it keeps the socket open when the server closes
	// its own. Then the servers stop: no verdict comes after that.
	prev := d.prevGeneration()
	files := map[*generation]*os.File{}
	for _, g := range []*generation{prev, cur} {
		if g == nil {
			continue
		}
		f, err := g.l.File()
		g.stop()
		if err != nil {
			d.log.Warn("cannot hand over the registration socket; the next instance publishes its own", "socket", g.path, "err", err)
			continue
		}
		files[g] = f
	}
	if cur != nil {
		if v := d.takeVerdict(cur); v != nil && d.lateVerdict(cur, v) == nil {
			if f := files[cur]; f != nil {
				f.Close()
			}
			delete(files, cur)
		}
	}
	h := &handover.Driver{
		Spec:          d.spec,
		Endpoint:      d.at.endpoint,
		LocalEndpoint: d.at.local,
		EndpointID:    d.probed,
		Status:        handedStatus(d.status()),
		Timeout:       d.p.timeout,
		Failures:      d.p.failures,
	}
	if d.nodeInfo != nil {
		h.NodeInfo, _ = proto.Marshal(d.nodeInfo)
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
	d.ro = nil
	return h
}

// handedStatus is st as a hand-over carries it: what the next loop goes on from. Its name,
// type, endpoint and required are the receiver's configuration's, and kubelet's view is read
// anew.
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

// inheritedStatus is the status of d's loop going on from hs, as handedStatus carried it:
// what hs does not say is d's own (its name, type, endpoint and required), or a fresh loop's.
func (d *driver) inheritedStatus(hs handover.Status) DriverStatus {
	st := DriverStatus{
		Name:             d.spec.Name,
		Type:             d.spec.Type,
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

// lateVerdict takes a verdict on g that came as the loop stopped for a hand-over, as the loop
// would have: a registration is recorded (and a CSI driver's NodeGetInfo with it); a rejection
// retires g and plans the next attempt after the backoff. It returns what is left to hand
// over: g, or nil.
func (d *driver) lateVerdict(g *generation, v *regserver.Verdict) *generation {
	if v.Registered {
		d.accepted(context.Background(), g) // the loop's context has ended; the call has its own timeout
		return g
	}
	d.record(evRejected)
	d.retire(g)
	d.failed(v.Rejection())
	return nil
}

// inherit makes the loop, before it runs, go on from h: it serves h's sockets at once, and
// takes the status, the target, the recorded NodeGetInfo and the pacing. A socket that is no
// longer the file at its path, or not a listening socket, is closed: the loop publishes anew.
// It returns how many sockets it serves.
func (d *driver) inherit(h *handover.Driver) int {
	n := 0
	a := &adoption{epID: h.EndpointID}
	if d.spec.EndpointIsPattern() {
		d.at = handedTarget(d.spec, h.Endpoint)
	}
	d.nodeInfo = handedNodeInfo(h)
	d.probed = a.epID
	d.p.inherit(h.Timeout, h.Failures)

	st := d.inheritedStatus(h.Status)
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
		g, err := d.adoptSocket(hs)
		if err != nil {
			d.log.Warn("a handed-over registration socket cannot be served; publishing anew", "socket", hs.Path, "err", err)
			continue
		}
		n++
		if hs.Prev {
			d.ro = &rollover{prev: g}
		} else {
			a.cur = g
			d.adoptHealth(hs.Versions, a.epID)
		}
	}
	switch {
	case a.cur == nil && d.ro == nil && st.Phase != BackingOff:
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
	d.mu.Lock()
	d.st = st
	d.mu.Unlock()
	d.adopted = a
	return n
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
	if !spec.EndpointIsPattern() {
		return fixedTarget(spec)
	}
	return target{endpoint: endpoint, local: filepath.Join(filepath.Dir(spec.LocalEndpoint), filepath.Base(endpoint))}
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

// adoptSocket serves a handed-over socket as a generation of this loop.
func (d *driver) adoptSocket(hs *handover.Socket) (*generation, error) {
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
	id := hs.ID
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
	t := handedTarget(d.spec, hs.Endpoint)
	versions := hs.Versions
	if versions == nil { // a predecessor that did not say: it advertised the configured ones
		versions = d.spec.SupportedVersions
	}
	g, err := d.serveOn(l, hs.Path, id, hs.Generation, t, versions, hs.AwaitsVerdict)
	if err != nil {
		l.Close()
		return nil, err
	}
	g.registered = hs.Registered
	return g, nil
}

// takeOver decides, once the endpoint answers (its socket ep), what becomes of the socket a
// hand-over gave the loop (cur; a.cur), from what the other instance told: kubelet's verdict on
// an unregistered one is awaited, and a registered one kept, while the endpoint is the one the
// other instance last probed; a driver restarted meanwhile is decided as after any restart
// (restart.go); a newer instance of the endpoint is rolled over to. Otherwise the loop
// publishes anew.
func (l *loop) takeOver(a *adoption, ep fsid.ID) state {
	d, cur := l.d, l.cur
	same := !d.spec.WaitForEndpoint || a.epID == (fsid.ID{}) || ep == a.epID
	switch {
	case !cur.registered && same:
		if cur.at == d.at {
			return stAwaitingVerdict // kubelet owes it a verdict: awaited, with the registration timeout
		}
		return stPublishing
	case !cur.registered:
		d.reregister("why", "the driver restarted during the hand-over")
		return stPublishing
	case cur.at != d.at: // a newer instance of the endpoint answers
		if d.rollsOver() && d.ro == nil {
			d.startRollover(cur)
			l.cur = nil
		}
		return stPublishing
	case same:
		return stRegistered
	case d.keepsOnRestart(cur):
		if d.keepsRegistration(l.ctx, cur) {
			return stRegistered
		}
		return stPublishing
	}
	d.reregister("why", "the driver restarted during the hand-over")
	return stPublishing
}
