// Package agent keeps, on the node's own Node object, the condition that is True only when
// kubelet holds every required driver as kubelet itself records it (nodecond.Evaluate), and
// removes a startup taint the first time it is. It is the agent process's (cmd/multireg-
// nodecond): multireg passes it the drivers' state (kubelet's verdicts) and kubelet's
// pod-resources view; it watches the node's Node and CSINode by name, and writes only when the
// Node shows another value than the one it should, never on a clock, and at a bounded rate. A
// failing API server delays the condition, never a registration: multireg's loops run in
// another process, and nothing there waits for this one.
package agent

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"reflect"
	"sync"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/resourceversion"
	"k8s.io/client-go/dynamic"

	"multireg.dev/multireg/internal/kubeapi"
	"multireg.dev/multireg/internal/pause"
	"multireg.dev/multireg/nodecond"
)

// Options configure a Reporter.
type Options struct {
	// Client reaches the API server (kubeapi.Connect).
	Client dynamic.Interface
	// Node is the node's name; Type the condition's type (nodecond.CheckConditionType).
	Node, Type string
	// Taint, if set, is removed from the node the first time the condition is True on it.
	Taint *nodecond.Taint
	Log   *slog.Logger
}

// When the condition is written: once what it should say has not changed for settle (a
// thousand drivers registering in kubelet's pass write once, not once each), or has kept
// changing for hold; and within the write rate: writeBurst writes at once, then one each
// writeEvery (jittered), while the condition keeps changing (a flapping driver). A node whose
// drivers do not change writes nothing.
const (
	settle     = 250 * time.Millisecond
	hold       = 750 * time.Millisecond
	writeBurst = 10
	writeEvery = 30 * time.Second
)

// minEval spaces the evaluations of a burst of changes (a thousand drivers starting).
const minEval = 100 * time.Millisecond

// Reporter keeps the node condition. Run runs it; Status and the collector read it.
type Reporter struct {
	o   Options
	log *slog.Logger

	// guards st, in, and the latest node and CSINode the watches saw.
	mu sync.Mutex
	st nodecond.Status
	// readErr and writeErr: why the watches' last read failed, and the last write ("" once
	// one succeeds); st.LastError is the write's, else the read's.
	readErr, writeErr string
	// in is multireg's last word on its drivers (SetInput); hasInput: it has said one.
	in       nodecond.Input
	hasInput bool
	// node, csiNode: what the watches of the Node and the CSINode read; seen is signalled
	// (cap 1) at each read, and at each input.
	node, csiNode watched
	seen          chan struct{}
	// changed is closed, and replaced, when st changes (Changed).
	changed chan struct{}
}

// watched is what a watch of one object read: the newest version (nil: it does not exist),
// whether one was read, and why the last read failed.
type watched struct {
	obj  *unstructured.Unstructured
	read bool
	err  error
}

// New returns a reporter; Run starts it.
func New(o Options) *Reporter {
	log := o.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Reporter{o: o, log: log.With("nodeCondition", o.Type), seen: make(chan struct{}, 1), changed: make(chan struct{}),
		st: nodecond.Status{Type: o.Type, Node: o.Node, Taint: o.Taint}}
}

// SetInput gives the reporter the drivers' state and kubelet's pod-resources view as they are
// now. The condition is not written before the first.
func (r *Reporter) SetInput(in nodecond.Input) {
	r.mu.Lock()
	r.in, r.hasInput = in, true
	r.mu.Unlock()
	r.signal()
}

// Status returns what the reporter knows now.
func (r *Reporter) Status() nodecond.Status {
	r.mu.Lock()
	defer r.mu.Unlock()
	st := r.st
	st.CSINode.Drivers = maps.Clone(st.CSINode.Drivers)
	return st
}

// Changed returns a channel closed at the next change of Status.
func (r *Reporter) Changed() <-chan struct{} {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.changed
}

// Run keeps the condition until ctx ends: it watches the Node and the CSINode by name, and
// writes the condition whenever the node shows another value than the one it should. It
// returns when ctx ends, after its watches have.
func (r *Reporter) Run(ctx context.Context) error {
	var wg sync.WaitGroup
	wg.Go(func() { r.watch(ctx, kubeapi.Nodes, &r.node) })
	wg.Go(func() { r.watch(ctx, kubeapi.CSINodes, &r.csiNode) })
	defer wg.Wait()
	r.loop(ctx)
	return nil
}

// watch keeps w, the object of resource gvr named as the node, until ctx ends.
func (r *Reporter) watch(ctx context.Context, gvr schema.GroupVersionResource, w *watched) {
	kubeapi.Watch(ctx, r.o.Client, gvr, r.o.Node, func(e kubeapi.Event) {
		r.mu.Lock()
		if e.Err == nil {
			w.obj, w.read = newer(w.obj, e.Object), true
		}
		w.err = e.Err
		r.mu.Unlock()
		r.signal()
	})
}

// notify wakes whoever waits on Changed. mu is held.
func (r *Reporter) notify() {
	close(r.changed)
	r.changed = make(chan struct{})
}

// signal wakes the loop: a watch saw something, or multireg said something.
func (r *Reporter) signal() {
	select {
	case r.seen <- struct{}{}:
	default:
	}
}

// loop evaluates the condition at each change of its inputs and writes it when the node
// shows another value, within the write rate and, after a failure, its backoff.
func (r *Reporter) loop(ctx context.Context) {
	lim := limiter{tokens: writeBurst}
	failures := kubeapi.NewBackoff()
	var retryAt time.Time // after a failed write: not before
	warned := map[string]bool{}
	listed := map[string]time.Time{} // since when this process has seen each driver in CSINode
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	var lastEval time.Time
	var nodeLogged, apiDown bool
	// desired is what the condition should say, since when it has said it, and since when
	// the node has shown something else (pending; zero: the node shows it).
	var desired condition
	var desiredSince, pending time.Time
	for {
		if wait := minEval - time.Since(lastEval); wait > 0 {
			if !pause.For(ctx, wait) {
				return
			}
		}
		lastEval = time.Now()

		// The inputs.
		r.mu.Lock()
		nodeObj, nodeRead, csiObj, csiRead := r.node.obj, r.node.read, r.csiNode.obj, r.csiNode.read
		apiErr := errors.Join(r.node.err, r.csiNode.err)
		in, hasInput := r.in, r.hasInput
		r.mu.Unlock()
		n, err := readNode(nodeObj, r.o.Type)
		if err != nil {
			r.log.Warn("cannot read the Node", "node", r.o.Node, "err", err)
		}
		names, err := readCSINode(csiObj)
		if err != nil {
			r.log.Warn("cannot read the node's CSINode", "node", r.o.Node, "err", err)
		}
		now := time.Now()
		for _, name := range names {
			if _, ok := listed[name]; !ok {
				listed[name] = now
			}
		}
		for name := range listed {
			if !contains(names, name) {
				delete(listed, name)
			}
		}
		in.CSINode, in.Now = nodecond.CSINode{Known: csiRead, Drivers: maps.Clone(listed)}, now
		v := nodecond.Evaluate(in)
		r.warnCSINode(v, warned)

		switch {
		case apiErr != nil && !apiDown:
			r.log.Warn("the API server cannot be read; the node condition waits for it (registration does not)", "err", apiErr)
			apiDown = true
		case apiErr == nil && apiDown:
			r.log.Info("the API server answers again")
			apiDown = false
		}
		if nodeRead && !n.exists && !nodeLogged {
			r.log.Warn("no Node of this name: the node condition waits for it", "node", r.o.Node)
		}
		nodeLogged = nodeRead && !n.exists

		// The write, if the node shows another value, once that value has settled.
		next := time.Time{}
		want := condition{Type: r.o.Type, Status: nodecond.StatusOf(v.True), Reason: v.Reason, Message: v.Message}
		if !sameValue(&desired, want) {
			desired, desiredSince = want, now
		}
		// Nothing is written before multireg has said what its drivers are.
		differs := hasInput && nodeRead && n.exists && !sameValue(n.cond, want)
		switch {
		case !differs:
			pending = time.Time{}
		case pending.IsZero():
			pending = now
		}
		if differs {
			due := desiredSince.Add(settle)
			if held := pending.Add(hold); held.Before(due) {
				due = held
			}
			switch {
			case now.Before(due):
				next = due
			case now.Before(retryAt):
				next = retryAt
			}
		}
		if differs && next.IsZero() {
			switch ok, wait := lim.allow(now); {
			case !ok:
				next = now.Add(wait)
			default:
				written, err := r.write(ctx, n, want, now)
				if err != nil {
					if ctx.Err() != nil {
						return
					}
					retryAt = now.Add(failures.NextBackOff())
					next = retryAt
					r.noteError(err)
				} else {
					failures.Reset()
					retryAt = time.Time{}
					n = written
					r.noteWrite(now)
				}
			}
		}
		// The startup taint, once the node shows the condition True.
		if r.o.Taint != nil && hasInput && !r.Status().TaintDone && n.exists && n.cond != nil && n.cond.Status == "True" {
			if err := r.removeTaint(ctx, n); err != nil {
				if ctx.Err() != nil {
					return
				}
				r.noteError(err)
				if next.IsZero() || next.After(now.Add(time.Second)) {
					next = now.Add(failures.NextBackOff())
				}
			}
		}
		if t := notListedAt(v, in); !t.IsZero() && (next.IsZero() || t.Before(next)) {
			next = t
		}

		r.mu.Lock()
		was := r.st
		r.st.Verdict, r.st.NodeRead, r.st.NodeExists = v, nodeRead, n.exists
		r.st.CSINode = in.CSINode
		r.st.OnNode = nil
		if c := n.cond; c != nil {
			r.st.OnNode = &nodecond.Condition{Status: c.Status, Reason: c.Reason, Message: c.Message, LastTransitionTime: c.LastTransitionTime}
		}
		r.readErr = ""
		if apiErr != nil {
			r.readErr = apiErr.Error()
		}
		r.st.LastError = cmp.Or(r.writeErr, r.readErr)
		if !reflect.DeepEqual(was, r.st) {
			r.notify()
		}
		r.mu.Unlock()

		if !next.IsZero() {
			timer.Reset(max(time.Until(next), 0))
		} else {
			timer.Stop()
		}
		select {
		case <-ctx.Done():
			return
		case <-r.seen:
		case <-timer.C:
		}
	}
}

// Withdrawn writes the condition Unknown (nodecond.ReasonStopped), once Run has returned, after multireg
// removed every registration socket on its way out: nothing keeps the condition after that. It
// is one attempt, bounded by ctx.
func (r *Reporter) Withdrawn(ctx context.Context) error {
	r.mu.Lock()
	obj := r.node.obj
	r.mu.Unlock()
	n, err := readNode(obj, r.o.Type)
	if err != nil || !n.exists {
		return err
	}
	_, err = r.write(ctx, n, condition{Type: r.o.Type, Status: "Unknown", Reason: nodecond.ReasonStopped,
		Message: "multireg stopped with --cleanup-on-exit and withdrew every registration of this node: nothing keeps this condition"}, time.Now())
	return err
}

// write patches the condition want onto the node's status (a strategic merge by type: the
// node's other conditions are kubelet's and stay), and returns the node as the API server
// answered. The transition time is kept while the status stays.
func (r *Reporter) write(ctx context.Context, n node, want condition, now time.Time) (node, error) {
	want.LastHeartbeatTime = now.UTC().Truncate(time.Second)
	want.LastTransitionTime = want.LastHeartbeatTime
	if n.cond != nil && n.cond.Status == want.Status && !n.cond.LastTransitionTime.IsZero() {
		want.LastTransitionTime = n.cond.LastTransitionTime
	}
	patch, err := json.Marshal(map[string]any{"status": map[string]any{"conditions": []condition{want}}})
	if err != nil {
		return n, err
	}
	wctx, cancel := context.WithTimeout(ctx, kubeapi.RequestTimeout)
	defer cancel()
	obj, err := r.o.Client.Resource(kubeapi.Nodes).Patch(wctx, r.o.Node, types.StrategicMergePatchType, patch, metav1.PatchOptions{FieldManager: fieldManager}, "status")
	if err != nil {
		return n, fmt.Errorf("write the condition on node %s: %w", r.o.Node, err)
	}
	if n.cond == nil || n.cond.Status != want.Status {
		r.log.Info("node condition changed", "node", r.o.Node, "status", want.Status, "reason", want.Reason, "message", want.Message)
	} else {
		r.log.Info("node condition updated", "node", r.o.Node, "status", want.Status, "reason", want.Reason, "message", want.Message)
	}
	written, err := readNode(obj, r.o.Type)
	if err != nil {
		return n, err
	}
	r.mu.Lock()
	r.node.obj = newer(r.node.obj, obj) // the watch may not have caught up
	r.mu.Unlock()
	return written, nil
}

// newer is obj, unless it is an older version of the object than cur: a watch that has not
// caught up with a write's answer. nil (the object is gone) is never older.
func newer(cur, obj *unstructured.Unstructured) *unstructured.Unstructured {
	if cur == nil || obj == nil || cur.GetUID() != obj.GetUID() {
		return obj
	}
	if c, err := resourceversion.CompareResourceVersion(obj.GetResourceVersion(), cur.GetResourceVersion()); err == nil && c < 0 {
		return cur
	}
	return obj
}

// fieldManager is multireg's name in the node's managed fields.
const fieldManager = "multireg"

// removeTaint removes the startup taint from the node, if it has it, and looks after it no
// more: the taint is removed once, never added back. The patch tests the taints it read, so
// that another writer's change in between fails it (the next look reads the node again).
func (r *Reporter) removeTaint(ctx context.Context, n node) error {
	t := *r.o.Taint
	if !n.hasTaint(t) {
		r.log.Info("the node condition is True and the node has no startup taint to remove", "taint", t.String())
		r.mu.Lock()
		r.st.TaintDone = true
		r.mu.Unlock()
		return nil
	}
	patch, err := json.Marshal([]map[string]any{
		{"op": "test", "path": "/spec/taints", "value": n.taints},
		{"op": "replace", "path": "/spec/taints", "value": n.withoutTaint(t)},
	})
	if err != nil {
		return err
	}
	pctx, cancel := context.WithTimeout(ctx, kubeapi.RequestTimeout)
	defer cancel()
	obj, err := r.o.Client.Resource(kubeapi.Nodes).Patch(pctx, r.o.Node, types.JSONPatchType, patch, metav1.PatchOptions{FieldManager: fieldManager})
	if apierrors.IsInvalid(err) || apierrors.IsConflict(err) {
		return fmt.Errorf("remove the startup taint %s from node %s: the node changed meanwhile; trying again: %w", t, r.o.Node, err)
	}
	if err != nil {
		return fmt.Errorf("remove the startup taint %s from node %s: %w", t, r.o.Node, err)
	}
	r.log.Info("removed the startup taint: every required plugin is registered", "taint", t.String(), "node", r.o.Node)
	r.mu.Lock()
	r.node.obj = newer(r.node.obj, obj)
	r.st.TaintRemoved, r.st.TaintDone = time.Now(), true
	r.writeErr = ""
	r.st.LastError = r.readErr
	r.mu.Unlock()
	return nil
}

// noteWrite and noteError record a write that succeeded, and one that failed: LastError is
// the last write's failure until a write succeeds, else the watches' (until they read again).
func (r *Reporter) noteWrite(at time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.st.Writes++
	r.writeErr = ""
	r.st.LastWrite, r.st.LastError = at, r.readErr
}

func (r *Reporter) noteError(err error) {
	r.log.Warn("node condition", "err", err)
	r.mu.Lock()
	defer r.mu.Unlock()
	r.st.WriteErrors++
	r.writeErr = err.Error()
	r.st.LastError = r.writeErr
}

// warnCSINode logs each CSI driver kubelet accepted that CSINode has not listed for longer
// than nodecond.CSINodeGrace, once when that begins and once when it ends.
func (r *Reporter) warnCSINode(v nodecond.Verdict, warned map[string]bool) {
	now := map[string]bool{}
	for _, e := range v.Evidence {
		if e.NotListed {
			now[e.Driver] = true
			if !warned[e.Driver] {
				r.log.Warn("kubelet accepted the CSI driver, and the node's CSINode does not list it", "driver", e.Driver, "grace", nodecond.CSINodeGrace)
			}
		}
	}
	for name := range warned {
		if !now[name] {
			r.log.Info("the node's CSINode lists the CSI driver, or it is no longer registered", "driver", name)
		}
	}
	clear(warned)
	maps.Copy(warned, now)
}

// notListedAt is when the next registered CSI driver missing from CSINode becomes a warning
// (zero: none will).
func notListedAt(v nodecond.Verdict, in nodecond.Input) time.Time {
	var at time.Time
	for _, d := range in.Drivers {
		if d.Type != "CSIPlugin" || d.Phase != "Registered" || !in.CSINode.Known {
			continue
		}
		if _, ok := in.CSINode.Drivers[d.Name]; ok {
			continue
		}
		t := d.Since.Add(nodecond.CSINodeGrace + time.Millisecond)
		if t.After(in.Now) && (at.IsZero() || t.Before(at)) {
			at = t
		}
	}
	return at
}

// sameValue reports whether the node's condition c says what want says: its status, reason
// and message (the times are the writer's).
func sameValue(c *condition, want condition) bool {
	return c != nil && c.Status == want.Status && c.Reason == want.Reason && c.Message == want.Message
}

func contains(names []string, name string) bool {
	for _, n := range names {
		if n == name {
			return true
		}
	}
	return false
}

// limiter is a token bucket: writeBurst writes, then one each writeEvery.
type limiter struct {
	tokens float64
	last   time.Time
}

// allow takes a token at now if there is one; otherwise it says how long until there is.
func (l *limiter) allow(now time.Time) (bool, time.Duration) {
	if !l.last.IsZero() {
		l.tokens = min(writeBurst, l.tokens+float64(now.Sub(l.last))/float64(writeEvery))
	}
	l.last = now
	if l.tokens >= 1 {
		l.tokens--
		return true, 0
	}
	return false, kubeapi.Jitter(time.Duration((1 - l.tokens) * float64(writeEvery)))
}
