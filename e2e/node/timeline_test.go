package node_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/resourceversion"
	"k8s.io/apimachinery/pkg/watch"

	"multireg.dev/multireg/e2e/node/cluster"
)

// timeline records what the node-condition scenarios look at as the API server's watches
// deliver it: the node's Node (multireg's condition, the taints), its CSINode (the CSI drivers
// kubelet registered) and, when named, one pod of the default namespace (scheduled or not),
// each version with when the test received it. Times from two watches are comparable to a
// few ms (two streams of one API server on 127.0.0.1); the order of two changes is the order
// of their resource versions (one etcd: its revisions).
type timeline struct {
	cancel context.CancelFunc
	wg     sync.WaitGroup
	mu     sync.Mutex
	events []tlEvent
	err    error
}

// tlEvent is one version of one object, received at at: exactly one of node, csi and pod.
type tlEvent struct {
	at   time.Time
	node *corev1.Node
	csi  *storagev1.CSINode
	pod  *corev1.Pod
}

// rv is the event's object's resource version.
func (e tlEvent) rv() string {
	switch {
	case e.node != nil:
		return e.node.ResourceVersion
	case e.csi != nil:
		return e.csi.ResourceVersion
	case e.pod != nil:
		return e.pod.ResourceVersion
	}
	return ""
}

// before reports whether e's object version was written before o's (their resource versions,
// one etcd's revisions).
func (e tlEvent) before(t *testing.T, o tlEvent) bool {
	t.Helper()
	c, err := resourceversion.CompareResourceVersion(e.rv(), o.rv())
	if err != nil {
		t.Fatalf("resource versions %q and %q: %v", e.rv(), o.rv(), err)
	}
	return c < 0
}

// watchTimeline starts the watches: the node's Node and CSINode, and the pod pod of the
// default namespace unless pod is "". The test stops them at its end.
func watchTimeline(t *testing.T, pod string) *timeline {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	tl := &timeline{cancel: cancel}
	byName := fields.OneTermEqualSelector("metadata.name", cluster.NodeName).String()
	nodes, csiNodes := cl.Client.CoreV1().Nodes(), cl.Client.StorageV1().CSINodes()
	tl.follow(ctx, "Node", byName,
		func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) { return nodes.List(ctx, o) },
		nodes.Watch, func(o runtime.Object) tlEvent { return tlEvent{node: o.(*corev1.Node)} })
	tl.follow(ctx, "CSINode", byName,
		func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) { return csiNodes.List(ctx, o) },
		csiNodes.Watch, func(o runtime.Object) tlEvent { return tlEvent{csi: o.(*storagev1.CSINode)} })
	if pod != "" {
		pods := cl.Client.CoreV1().Pods("default")
		tl.follow(ctx, "Pod "+pod, fields.OneTermEqualSelector("metadata.name", pod).String(),
			func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) { return pods.List(ctx, o) },
			pods.Watch, func(o runtime.Object) tlEvent { return tlEvent{pod: o.(*corev1.Pod)} })
	}
	t.Cleanup(tl.stop)
	return tl
}

// follow lists what sel selects, records it, and records every change a watch from there
// delivers (watching again from the last version when the API server ends a watch), until
// ctx ends or a watch fails.
func (tl *timeline) follow(ctx context.Context, what, sel string,
	list func(context.Context, metav1.ListOptions) (runtime.Object, error),
	watchFn func(context.Context, metav1.ListOptions) (watch.Interface, error),
	event func(runtime.Object) tlEvent) {
	lctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	obj, err := list(lctx, metav1.ListOptions{FieldSelector: sel})
	if err != nil {
		tl.fail(fmt.Errorf("list %s: %w", what, err))
		return
	}
	items, err := meta.ExtractList(obj)
	if err != nil {
		tl.fail(fmt.Errorf("list %s: %w", what, err))
		return
	}
	for _, it := range items {
		tl.add(event(it))
	}
	lm, err := meta.ListAccessor(obj)
	if err != nil {
		tl.fail(fmt.Errorf("list %s: %w", what, err))
		return
	}
	rv := lm.GetResourceVersion()
	tl.wg.Go(func() {
		for ctx.Err() == nil {
			w, err := watchFn(ctx, metav1.ListOptions{FieldSelector: sel, ResourceVersion: rv})
			if err != nil {
				if ctx.Err() == nil {
					tl.fail(fmt.Errorf("watch %s: %w", what, err))
				}
				return
			}
			for ev := range w.ResultChan() {
				switch ev.Type {
				case watch.Error:
					tl.fail(fmt.Errorf("watch %s: %v", what, ev.Object))
					w.Stop()
					return
				case watch.Added, watch.Modified:
					e := event(ev.Object)
					tl.add(e)
					rv = e.rv()
				}
			}
			w.Stop()
		}
	})
}

func (tl *timeline) add(e tlEvent) {
	e.at = time.Now()
	tl.mu.Lock()
	defer tl.mu.Unlock()
	tl.events = append(tl.events, e)
}

func (tl *timeline) fail(err error) {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	if tl.err == nil {
		tl.err = err
	}
}

// stop ends the watches; it may be called more than once.
func (tl *timeline) stop() {
	tl.cancel()
	tl.wg.Wait()
}

// snapshot returns the events so far, and the first watch error.
func (tl *timeline) snapshot() ([]tlEvent, error) {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	return append([]tlEvent(nil), tl.events...), tl.err
}

// first returns the first event received at or after from for which pred holds.
func (tl *timeline) first(from time.Time, pred func(tlEvent) bool) (tlEvent, bool) {
	events, _ := tl.snapshot()
	for _, e := range events {
		if !e.at.Before(from) && pred(e) {
			return e, true
		}
	}
	return tlEvent{}, false
}

// await waits up to d for the first event at or after from for which pred holds, and returns
// it; the failure names what was awaited and the multireg conditions seen.
func (tl *timeline) await(t *testing.T, d time.Duration, what string, from time.Time, pred func(tlEvent) bool) tlEvent {
	t.Helper()
	var found tlEvent
	waitUntil(t, d, what, func(context.Context) (bool, string) {
		e, ok := tl.first(from, pred)
		if ok {
			found = e
			return true, ""
		}
		events, err := tl.snapshot()
		if err != nil {
			return false, err.Error()
		}
		return false, "the node's condition: " + tl.conditions(events, from)
	})
	return found
}

// conditions describes multireg's condition as the Node events from from on showed it, each
// distinct value once.
func (tl *timeline) conditions(events []tlEvent, from time.Time) string {
	var out []string
	last := ""
	for _, e := range events {
		if e.node == nil || e.at.Before(from) {
			continue
		}
		s := "none"
		if c := ncCondition(e.node); c != nil {
			s = fmt.Sprintf("%s %s %q", c.Status, c.Reason, c.Message)
		}
		if s != last {
			out = append(out, s)
			last = s
		}
	}
	if len(out) == 0 {
		return "no Node event"
	}
	return strings.Join(out, " → ")
}

// nodes returns the Node events received in [from, to).
func (tl *timeline) nodes(from, to time.Time) []tlEvent {
	events, _ := tl.snapshot()
	var out []tlEvent
	for _, e := range events {
		if e.node != nil && !e.at.Before(from) && e.at.Before(to) {
			out = append(out, e)
		}
	}
	return out
}

// gap is what a span of the timeline showed of something the node should show: how many times
// it went missing, and the longest it stayed so.
type gap struct {
	times   int
	longest time.Duration
}

func (g gap) String() string {
	return fmt.Sprintf("%d times, longest %dms", g.times, g.longest.Milliseconds())
}

// gaps measures, over the events received in [from, to) for which sel holds, each time holds
// stopped holding after it had held, until it held again (or until to, when it never did):
// how often, and the longest. The last such event before from says how things stood at from
// (missing then: one time, counted from from). Before holds first held nothing is counted:
// something not there yet is not missing.
func (tl *timeline) gaps(from, to time.Time, sel, holds func(tlEvent) bool) gap {
	events, _ := tl.snapshot()
	var g gap
	held, missing := false, false
	for _, e := range events {
		if e.at.Before(from) && sel(e) {
			ok := holds(e)
			held = held || ok
			missing = held && !ok
		}
	}
	var since time.Time // when it went missing; zero while it is there
	if missing {
		g.times, since = 1, from
	}
	for _, e := range events {
		if e.at.Before(from) || !e.at.Before(to) || !sel(e) {
			continue
		}
		switch ok := holds(e); {
		case ok && !since.IsZero():
			g.longest = max(g.longest, e.at.Sub(since))
			since = time.Time{}
			held = true
		case ok:
			held = true
		case held && since.IsZero():
			g.times++
			since = e.at
		}
	}
	if !since.IsZero() {
		g.longest = max(g.longest, to.Sub(since))
	}
	return g
}
