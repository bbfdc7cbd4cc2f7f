package registrar

import (
	"context"
	"fmt"
	"math"
	"net"
	"os"
	"slices"
	"time"

	csi "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/proto"
	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/fswatch"
	"multireg.dev/multireg/internal/handover"
	"multireg.dev/multireg/internal/regserver"
)

// How a loop hands its sockets and state to another instance, and how a loop goes on from
// what it was handed (internal/handover carries them between processes).

// adoption is what a loop starts from after a hand-over.
type adoption struct {
	cur      *generation // the socket handed over, served already; nil when there was none
	epID     fsid.ID     // the endpoint's socket as the other instance last probed it
	resumeAt time.Time   // a backing-off driver's next attempt
}

// detach stops the loop's generations for a hand-over and returns what the next instance
// needs: a copy of each listening socket, and the loop's state. The sockets stay, listening:
// the kernel queues kubelet's connections until the next instance accepts them. A socket that
// cannot be copied is left as it is, and the next instance publishes its own over it.
func (d *driver) detach(cur *generation) *handover.Driver {
	// A copy of each listening socket first: it keeps the socket open when the server closes
	// its own. Then the servers stop: no verdict comes after that.
	files := map[*generation]*os.File{}
	for _, g := range []*generation{d.prev, cur} {
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
	for _, g := range []*generation{d.prev, cur} {
		f := files[g]
		if g == nil || f == nil {
			continue
		}
		h.Sockets = append(h.Sockets, &handover.Socket{
			Prev:          g == d.prev,
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
	d.prev = nil
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
	d.record(endRejected)
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
		d.at = target{endpoint: h.Endpoint, local: h.LocalEndpoint}
	}
	d.nodeInfo = handedNodeInfo(h)
	d.probed = a.epID
	d.p.resume(h.Timeout, h.Failures)

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
			d.prev = g
		} else {
			a.cur = g
			d.adoptHealth(hs.Versions, a.epID)
		}
	}
	switch {
	case a.cur == nil && d.prev == nil && st.Phase != BackingOff:
		st.Phase, st.Since = WaitingForEndpoint, time.Now()
	case a.cur == nil && st.Phase == BackingOff && st.NextAttempt.After(time.Now()):
		st.NextAttempt = d.boundedAttempt(st.NextAttempt)
		a.resumeAt = st.NextAttempt
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
	t := target{endpoint: hs.Endpoint, local: hs.LocalEndpoint}
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

// adoptFlags decides, once the endpoint is ready, what the loop does with the socket a
// hand-over gave it (cur; a.cur): keep a registered one (resume) unless the driver restarted
// meanwhile (restarted, as after any restart: restart.go), or wait for the verdict kubelet
// owes an unregistered one (pending). Otherwise the loop publishes anew.
func (d *driver) adoptFlags(a *adoption, cur *generation, epID fsid.ID) (resume, restarted, pending bool) {
	switch {
	case cur == nil || cur != a.cur:
		return false, false, false
	case !cur.registered && (!d.spec.WaitForEndpoint || a.epID == (fsid.ID{}) || epID == a.epID):
		return false, false, true
	case !cur.registered:
		d.reregister("why", "the driver restarted during the hand-over")
		return false, false, false
	case cur.at != d.at:
		return d.handover(), false, false // a newer instance of the endpoint answers
	case !d.spec.WaitForEndpoint || a.epID == (fsid.ID{}) || epID == a.epID:
		return true, false, false
	case d.keepsOnRestart(cur):
		return false, true, false
	}
	d.reregister("why", "the driver restarted during the hand-over")
	return false, false, false
}

// sleepUntilResume waits, as a backing-off loop, until the next attempt the other instance
// had planned. It reports false when ctx ends first.
func (d *driver) sleepUntilResume(ctx context.Context, at time.Time, ws watches) bool {
	_, ok := sleepUntil(ctx, time.Until(at), ws.ep, func(fswatch.Change) bool {
		d.lookPresence()
		return false
	})
	return ok
}
