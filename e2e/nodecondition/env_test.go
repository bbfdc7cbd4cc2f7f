package nodecondition

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/util/retry"

	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/kubelet"
	"multireg.dev/multireg/e2e/mrproc"
	"multireg.dev/multireg/e2e/testenv"
)

// condType is the condition the tests have multireg keep.
const condType = "multireg.dev/PluginsRegistered"

const (
	registerTimeout = testenv.RegisterTimeout
	exitTimeout     = testenv.ExitTimeout
)

type driver = testenv.Driver

// required is a driver of the given type that the condition waits for.
func required(name, typ string) driver {
	return driver{Name: name, Type: typ, Extra: "    required: true\n"}
}

// node is one test's node: a Node and its CSINode in the shared API server, and a kubelet
// (the plugin manager) that records its CSI drivers in that CSINode, on a plugins-registry
// directory of its own.
type node struct {
	t    *testing.T
	name string
	*testenv.Env

	mu      sync.Mutex
	changes []change // the condition as the node showed it, each time it changed
	// unlisted: CSI drivers kubelet registers without recording them in CSINode.
	unlisted map[string]bool
	csiNodes func(ctx context.Context, driver string, install bool) error
}

// change is the condition as the node showed it, and when the test saw it.
type change struct {
	At   time.Time
	Cond *corev1.NodeCondition // nil: none
}

// newNode creates a Node (with taints) and its CSINode, starts its kubelet, and watches the
// condition on it.
func newNode(t *testing.T, taints ...corev1.Taint) *node {
	t.Helper()
	b := make([]byte, 4)
	rand.Read(b)
	n := &node{t: t, name: "n-" + hex.EncodeToString(b), unlisted: map[string]bool{}}
	ctx := t.Context()
	if _, err := api.client.CoreV1().Nodes().Create(ctx, &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: n.name},
		Spec:       corev1.NodeSpec{Taints: taints},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := api.client.StorageV1().CSINodes().Create(ctx, &storagev1.CSINode{
		ObjectMeta: metav1.ObjectMeta{Name: n.name},
		Spec:       storagev1.CSINodeSpec{Drivers: []storagev1.CSINodeDriver{}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx := context.Background()
		api.client.StorageV1().CSINodes().Delete(ctx, n.name, metav1.DeleteOptions{})
		api.client.CoreV1().Nodes().Delete(ctx, n.name, metav1.DeleteOptions{})
	})
	n.csiNodes = kubelet.CSINodeWriter(api.client, n.name)
	n.Env = testenv.NewWithoutKubelet(t)
	n.KubeletOptions.CSINode = n.csiNode
	n.StartKubelet()
	wctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		n.record(wctx)
	}()
	t.Cleanup(func() {
		cancel()
		<-done
		if t.Failed() {
			t.Logf("the condition on node %s:\n%s", n.name, n.history())
		}
	})
	return n
}

// csiNode records driver in the node's CSINode, or removes it, as kubelet's CSI handler does.
func (n *node) csiNode(ctx context.Context, driver string, install bool) error {
	n.mu.Lock()
	skip := n.unlisted[driver]
	n.mu.Unlock()
	if skip && install {
		return nil
	}
	return n.csiNodes(ctx, driver, install)
}

// unlist makes kubelet register the CSI driver without recording it in CSINode.
func (n *node) unlist(driver string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.unlisted[driver] = true
}

// start starts multireg with the node condition on, for ds.
func (n *node) start(ds []driver, args ...string) *mrproc.Process {
	n.t.Helper()
	return mrproc.Start(n.t, n.WriteConfig(ds), n.args(args...)...)
}

// running starts the drivers' endpoints and a multireg with the node condition for them, and
// waits for the condition True; it returns the process and that change.
func (n *node) running(ds []driver, args ...string) (*mrproc.Process, change) {
	n.t.Helper()
	n.StartEndpoints(ds)
	start := time.Now()
	p := n.start(ds, args...)
	return p, n.await("the condition True", start, isTrue)
}

// args are multireg's arguments for the node condition on this node, then more.
func (n *node) args(more ...string) []string {
	return append([]string{"--node-condition", condType, "--node-name", n.name, "--kubeconfig", api.cp.Kubeconfig}, more...)
}

// record watches the node, and records each change of the condition, until ctx ends. It
// watches again after the API server went away.
func (n *node) record(ctx context.Context) {
	var last *corev1.NodeCondition
	note := func(nd *corev1.Node) {
		var c *corev1.NodeCondition
		for i := range nd.Status.Conditions {
			if string(nd.Status.Conditions[i].Type) == condType {
				c = &nd.Status.Conditions[i]
			}
		}
		if same(c, last) {
			return
		}
		last = c
		n.mu.Lock()
		n.changes = append(n.changes, change{At: time.Now(), Cond: c})
		n.mu.Unlock()
	}
	for ctx.Err() == nil {
		w, err := api.client.CoreV1().Nodes().Watch(ctx, metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("metadata.name", n.name).String()})
		if err != nil {
			select {
			case <-ctx.Done():
			case <-time.After(100 * time.Millisecond):
			}
			continue
		}
		for ev := range w.ResultChan() {
			if nd, ok := ev.Object.(*corev1.Node); ok && ev.Type != watch.Deleted {
				note(nd)
			}
		}
		w.Stop()
	}
}

// same reports whether two conditions say the same (status, reason, message, transition).
func same(a, b *corev1.NodeCondition) bool {
	if a == nil || b == nil {
		return a == b
	}
	return a.Status == b.Status && a.Reason == b.Reason && a.Message == b.Message && a.LastTransitionTime.Equal(&b.LastTransitionTime)
}

// await waits for the condition to show, at or after since, what ok accepts, and returns the
// first change that did.
func (n *node) await(what string, since time.Time, ok func(c *corev1.NodeCondition) bool) change {
	n.t.Helper()
	var got change
	wait.For(n.t, registerTimeout, what, func() bool {
		n.mu.Lock()
		defer n.mu.Unlock()
		for _, c := range n.changes {
			if !c.At.Before(since) && ok(c.Cond) {
				got = c
				return true
			}
		}
		return false
	})
	return got
}

// now is the condition as the node shows it, as last seen.
func (n *node) now() *corev1.NodeCondition {
	n.mu.Lock()
	defer n.mu.Unlock()
	if len(n.changes) == 0 {
		return nil
	}
	return n.changes[len(n.changes)-1].Cond
}

// changesSince counts the changes seen at or after since.
func (n *node) changesSince(since time.Time) int {
	n.mu.Lock()
	defer n.mu.Unlock()
	c := 0
	for _, ch := range n.changes {
		if !ch.At.Before(since) {
			c++
		}
	}
	return c
}

func (n *node) history() string {
	n.mu.Lock()
	defer n.mu.Unlock()
	var b strings.Builder
	for _, c := range n.changes {
		if c.Cond == nil {
			fmt.Fprintf(&b, "\t%s none\n", c.At.Format("15:04:05.000"))
			continue
		}
		fmt.Fprintf(&b, "\t%s %s %s %q (since %s)\n", c.At.Format("15:04:05.000"), c.Cond.Status, c.Cond.Reason, c.Cond.Message, c.Cond.LastTransitionTime.Format("15:04:05"))
	}
	return b.String()
}

// isTrue and isFalse accept the condition True, or False with a message that holds each of
// parts.
func isTrue(c *corev1.NodeCondition) bool { return c != nil && c.Status == corev1.ConditionTrue }

func isFalse(parts ...string) func(c *corev1.NodeCondition) bool {
	return func(c *corev1.NodeCondition) bool {
		if c == nil || c.Status != corev1.ConditionFalse {
			return false
		}
		for _, p := range parts {
			if !strings.Contains(c.Message, p) {
				return false
			}
		}
		return true
	}
}

// taints returns the node's taints.
func (n *node) taints() []corev1.Taint {
	n.t.Helper()
	nd, err := api.client.CoreV1().Nodes().Get(n.t.Context(), n.name, metav1.GetOptions{})
	if err != nil {
		n.t.Fatal(err)
	}
	return nd.Spec.Taints
}

// setTaints replaces the node's taints.
func (n *node) setTaints(ts []corev1.Taint) {
	n.t.Helper()
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		nd, err := api.client.CoreV1().Nodes().Get(n.t.Context(), n.name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		nd.Spec.Taints = ts
		_, err = api.client.CoreV1().Nodes().Update(n.t.Context(), nd, metav1.UpdateOptions{})
		return err
	})
	if err != nil && !apierrors.IsNotFound(err) {
		n.t.Fatal(err)
	}
}
