package node_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/watch"

	"multireg.dev/multireg/e2e/node/cluster"
	"multireg.dev/multireg/e2e/node/endpoints"
)

// The DaemonSet scenario's CSI drivers.
const (
	csiD = "delta.csi.multireg.test"
	csiE = "epsilon.csi.multireg.test" // its endpoint is edited in the ConfigMap
	csiZ = "zeta.csi.multireg.test"
	// absentDRA is configured, but never runs on this node: a fleet's drivers file lists the
	// drivers of every node pool. The pod must be Ready anyway.
	absentDRA = "gpu.absent.multireg.test"
)

// 5. The shipped examples/ (DaemonSet + kustomization, copied verbatim) through a kustomize
// overlay that points the host paths at the test kubelet's root, the config at the test's
// drivers and the image at the locally built one, applied with `kubectl apply -k`:
//   - multireg runs as a pod, Ready and its rollout complete although a configured DRA
//     driver never runs on this node, and its drivers appear in CSINode;
//   - an edited ConfigMap, applied again, reaches multireg through kubelet's own volume
//     update and changes CSINode for the edited driver only (same pod, other sockets and
//     endpoints untouched);
//   - `kubectl rollout restart` replaces the pod; every driver is back in CSINode within
//     seconds; the longest absence of any driver is measured and bounded.
func scenarioDaemonSet(t *testing.T) {
	eps := map[string]*endpoints.CSI{}
	for _, e := range []struct{ name, dir, nodeID string }{
		{csiD, "delta", "delta-node-1"}, {csiE, "epsilon", "epsilon-node-1"},
		{"epsilon-v2", "epsilon-v2", "epsilon-node-2"}, {csiZ, "zeta", "zeta-node-1"},
	} {
		name := e.name
		if name == "epsilon-v2" {
			name = csiE // the same driver at a new endpoint, answering another node ID
		}
		ep, err := endpoints.StartCSI(endpointPath(e.dir, "csi.sock"), endpoints.CSIOptions{Name: name, NodeID: e.nodeID})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(ep.Stop)
		eps[e.name] = ep
	}

	dir := filepath.Join(tempDir(t), "manifests")
	overlay := writeOverlay(t, dir, endpointPath("epsilon", "csi.sock"))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	t.Cleanup(func() {
		dctx, dcancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer dcancel()
		if out, err := cl.Kubectl(dctx, "delete", "-k", overlay, "--wait=true", "--timeout=90s"); err != nil {
			t.Errorf("%v\n%s", err, out)
		}
		waitNoPods(t)
	})

	// Apply as shipped.
	start := time.Now()
	if out, err := cl.Kubectl(ctx, "apply", "-k", overlay); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	pod := waitPodReady(t, 3*time.Minute, "")
	t.Logf("multireg pod %s Ready %.1fs after kubectl apply -k (image %s)", pod.Name, time.Since(start).Seconds(), multiregRef)
	// What a user waits on after an apply: the rollout completes, the absent driver
	// notwithstanding.
	if out, err := cl.Kubectl(ctx, "rollout", "status", "-n", "kube-system", "daemonset/multireg", "--timeout=1m"); err != nil {
		t.Fatalf("kubectl rollout status after kubectl apply -k, with %s configured and absent: %v\n%s", absentDRA, err, out)
	}
	want := map[string]string{csiD: "delta-node-1", csiE: "epsilon-node-1", csiZ: "zeta-node-1"}
	waitCSINode(t, want, 60*time.Second)
	t.Logf("CSINode lists %s, %s, %s %.1fs after kubectl apply -k", csiD, csiE, csiZ, time.Since(start).Seconds())
	if out, err := cl.Kubectl(ctx, "exec", "-n", "kube-system", pod.Name, "--", "/multireg", "status"); err != nil {
		t.Errorf("multireg status inside the pod: %v", err)
	} else {
		t.Logf("kubectl exec %s -- /multireg status:\n%s", pod.Name, out)
		for _, n := range []string{csiD, csiE, csiZ} {
			if !strings.Contains(out, n) {
				t.Errorf("multireg status inside the pod does not list %s", n)
			}
		}
		if !strings.Contains(out, "3 of 4 drivers registered, 1 absent from this node") || !regexp.MustCompile(regexp.QuoteMeta(absentDRA)+`\s+DRAPlugin\s+Absent`).MatchString(out) {
			t.Errorf("multireg status inside the pod does not show %s absent", absentDRA)
		}
	}

	// Edit the ConfigMap: epsilon moves to its new endpoint.
	unchanged := []string{csiD, csiZ}
	podBefore := waitRegisteredAt(t, "multireg in pod "+pod.Name, podStatusURL(pod), csiD, csiE, csiZ)
	socks := idents(t, unchanged...)
	dOK, _ := eps[csiD].NodeGetInfoCalls()
	zOK, _ := eps[csiZ].NodeGetInfoCalls()
	writeOverlay(t, dir, endpointPath("epsilon-v2", "csi.sock"))
	start = time.Now()
	if out, err := cl.Kubectl(ctx, "apply", "-k", overlay); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	want[csiE] = "epsilon-node-2"
	d := waitCSINode(t, want, 60*time.Second)
	t.Logf("ConfigMap edit → CSINode shows %s's new node ID: %.1fs (kubelet's volume update + multireg's reload + kubelet's registration)", csiE, d.Seconds())
	figures = append(figures, fmt.Sprintf("ConfigMap edit applied → CSINode updated: %.1fs (kubelet syncFrequency 1s)", d.Seconds()))
	// Only epsilon moved, judged over a few reconcile passes: the other two were not
	// registered again nor their sockets published again, and multireg was not restarted.
	stays(t, 2500*time.Millisecond, "the edit touches only "+csiE, func(ctx context.Context) (string, error) {
		if d2, _ := eps[csiD].NodeGetInfoCalls(); d2 != dOK {
			return fmt.Sprintf("%s registered again (NodeGetInfo %d → %d)", csiD, dOK, d2), nil
		}
		if z2, _ := eps[csiZ].NodeGetInfoCalls(); z2 != zOK {
			return fmt.Sprintf("%s registered again (NodeGetInfo %d → %d)", csiZ, zOK, z2), nil
		}
		st, err := statusAt(ctx, podStatusURL(pod))
		if err != nil {
			return "", err
		}
		for _, n := range unchanged {
			if st[n].Phase != "Registered" || st[n].Attempts != podBefore[n].Attempts {
				return fmt.Sprintf("%s: %+v, before %+v", n, st[n], podBefore[n]), nil
			}
		}
		return "", nil
	})
	assertSame(t, "unedited drivers' sockets", socks, idents(t, unchanged...))
	now := waitPodReady(t, 30*time.Second, "")
	if now.UID != pod.UID || restarts(now) != 0 {
		t.Errorf("the ConfigMap edit restarted multireg: pod %s (uid %s, %d restarts), before %s (uid %s)",
			now.Name, now.UID, restarts(now), pod.Name, pod.UID)
	}

	// Rollout restart, watching CSINode throughout.
	w := watchCSINode(t)
	before := map[string]int{}
	for n, ep := range eps {
		before[n], _ = ep.NodeGetInfoCalls()
	}
	start = time.Now()
	if out, err := cl.Kubectl(ctx, "rollout", "restart", "-n", "kube-system", "daemonset/multireg"); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if out, err := cl.Kubectl(ctx, "rollout", "status", "-n", "kube-system", "daemonset/multireg", "--timeout=3m"); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	newPod := waitPodReady(t, 60*time.Second, string(pod.UID))
	rolled := time.Since(start)
	// The new pod registers each driver anew (kubelet calls NodeGetInfo again) …
	waitUntil(t, 60*time.Second, "kubelet registers every driver from the new pod", func(ctx context.Context) (bool, string) {
		for _, n := range []string{csiD, "epsilon-v2", csiZ} {
			if c, _ := eps[n].NodeGetInfoCalls(); c <= before[n] {
				return false, n + ": no new NodeGetInfo"
			}
		}
		return true, ""
	})
	// … and each is back in CSINode; the watch must have delivered that state (the API
	// server's resource version of it, at least) before its record is complete.
	waitCSINode(t, want, 60*time.Second)
	final, err := cl.Client.StorageV1().CSINodes().Get(ctx, cluster.NodeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	finalRV, err := strconv.ParseUint(final.ResourceVersion, 10, 64)
	if err != nil {
		t.Fatalf("CSINode resource version %q: %v", final.ResourceVersion, err)
	}
	waitUntil(t, 30*time.Second, "the CSINode watch catches up", func(context.Context) (bool, string) {
		rv, missing := w.progress()
		return rv >= finalRV && len(missing) == 0, fmt.Sprintf("watch at %d (want ≥ %d), missing %v", rv, finalRV, missing)
	})
	gaps, err := w.stop()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("rollout restart: new pod %s Ready %.1fs after `kubectl rollout restart`", newPod.Name, rolled.Seconds())
	longest := time.Duration(0)
	for _, n := range []string{csiD, csiE, csiZ} {
		var list []string
		for _, g := range gaps[n] {
			list = append(list, g.Round(time.Millisecond).String())
			longest = max(longest, g)
		}
		t.Logf("  %s missing from CSINode: %d time(s) %v", n, len(gaps[n]), list)
	}
	t.Logf("rollout restart: longest time any driver was missing from CSINode: %s", longest.Round(time.Millisecond))
	figures = append(figures, fmt.Sprintf("rollout restart: longest time a driver was missing from CSINode: %s", longest.Round(time.Millisecond)))
	// kubelet re-registers a recreated socket by unregistering it in one reconcile pass (1 s)
	// and registering it in the next; NodeGetInfo and the CSINode update follow: "a pass or
	// two". Longer would mean multireg itself kept a driver out.
	if longest > 3*time.Second {
		t.Errorf("a driver was missing from CSINode for %s during the rollout restart (bound 3s: kubelet's own re-registration, a reconcile pass or two)", longest)
	}
}

// podStatusURL is multireg's /status in pod, reached on the pod's IP (the DaemonSet serves
// HTTP on :9809).
func podStatusURL(pod corev1.Pod) string {
	return fmt.Sprintf("http://%s:9809/status", pod.Status.PodIP)
}

// writeOverlay writes DIR/base (the shipped examples, verbatim) and DIR/overlay (the test's
// drivers file, image, and host paths under the test kubelet's root); it returns the overlay.
func writeOverlay(t *testing.T, dir, epsilonEndpoint string) string {
	t.Helper()
	base, overlay := filepath.Join(dir, "base"), filepath.Join(dir, "overlay")
	for _, d := range []string{base, overlay} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, f := range []string{"daemonset.yaml", "kustomization.yaml", "config.yaml"} {
		b, err := os.ReadFile(filepath.Join(*examplesDir, f))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(base, f), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	config := fmt.Sprintf(`apiVersion: multireg.dev/v1alpha1
kind: RegistrarConfig
registrationDir: %s
drivers:
  - name: %s
    type: CSIPlugin
    endpoint: %s
  - name: %s
    type: CSIPlugin
    endpoint: %s
  - name: %s
    type: CSIPlugin
    endpoint: %s
  - name: %s
    type: DRAPlugin
    endpoint: %s
`, cl.PluginsRegistry, csiD, endpointPath("delta", "csi.sock"), csiE, epsilonEndpoint, csiZ, endpointPath("zeta", "csi.sock"),
		absentDRA, endpointPath("absent-gpu", "dra.sock"))
	kustomization := fmt.Sprintf(`apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
namespace: kube-system
resources:
  - ../base
configMapGenerator:
  - name: multireg
    behavior: replace
    files:
      - config.yaml
    options:
      disableNameSuffixHash: true
images:
  - name: registry.example/multireg
    newName: %[1]s
    newTag: %[2]s
patches:
  - target:
      kind: DaemonSet
      name: multireg
    patch: |-
      - {op: test, path: /spec/template/spec/volumes/0/name, value: registration-dir}
      - {op: replace, path: /spec/template/spec/volumes/0/hostPath/path, value: %[3]s}
      - {op: test, path: /spec/template/spec/volumes/1/name, value: plugins-dir}
      - {op: replace, path: /spec/template/spec/volumes/1/hostPath/path, value: %[4]s}
      - {op: test, path: /spec/template/spec/containers/0/volumeMounts/0/name, value: registration-dir}
      - {op: replace, path: /spec/template/spec/containers/0/volumeMounts/0/mountPath, value: %[3]s}
      - {op: test, path: /spec/template/spec/containers/0/volumeMounts/1/name, value: plugins-dir}
      - {op: replace, path: /spec/template/spec/containers/0/volumeMounts/1/mountPath, value: %[4]s}
`, strings.Split(multiregRef, ":")[0], strings.Split(multiregRef, ":")[1], cl.PluginsRegistry, cl.PluginsDir)
	for name, content := range map[string]string{"config.yaml": config, "kustomization.yaml": kustomization} {
		if err := os.WriteFile(filepath.Join(overlay, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return overlay
}

func multiregPods(ctx context.Context) ([]corev1.Pod, error) {
	list, err := cl.Client.CoreV1().Pods("kube-system").List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=multireg"})
	if err != nil {
		return nil, err
	}
	return list.Items, nil
}

// waitPodReady waits for exactly one multireg pod, Ready, other than the one with UID
// notUID; it reports the pod's state and events while waiting.
func waitPodReady(t *testing.T, d time.Duration, notUID string) corev1.Pod {
	t.Helper()
	var pod corev1.Pod
	waitUntil(t, d, "one Ready multireg pod", func(ctx context.Context) (bool, string) {
		pods, err := multiregPods(ctx)
		if err != nil {
			return false, err.Error()
		}
		var states []string
		var ready []corev1.Pod
		for _, p := range pods {
			states = append(states, podState(p))
			if string(p.UID) != notUID && p.DeletionTimestamp == nil && isReady(p) {
				ready = append(ready, p)
			}
		}
		if len(ready) == 1 && len(pods) == 1 {
			pod = ready[0]
			return true, ""
		}
		events, _ := cl.Kubectl(ctx, "get", "events", "-n", "kube-system", "--sort-by=.lastTimestamp")
		return false, fmt.Sprintf("pods: %v\nevents:\n%s", states, cluster.LastLines(events, 10))
	})
	return pod
}

func isReady(p corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

func restarts(p corev1.Pod) int32 {
	var n int32
	for _, cs := range p.Status.ContainerStatuses {
		n += cs.RestartCount
	}
	return n
}

func podState(p corev1.Pod) string {
	s := fmt.Sprintf("%s %s ready=%v", p.Name, p.Status.Phase, isReady(p))
	for _, cs := range p.Status.ContainerStatuses {
		switch {
		case cs.State.Waiting != nil:
			s += fmt.Sprintf(" waiting(%s: %s)", cs.State.Waiting.Reason, cs.State.Waiting.Message)
		case cs.State.Terminated != nil:
			s += fmt.Sprintf(" terminated(%s, exit %d)", cs.State.Terminated.Reason, cs.State.Terminated.ExitCode)
		}
	}
	return s
}

func waitNoPods(t *testing.T) {
	t.Helper()
	waitUntil(t, 2*time.Minute, "multireg pods gone", func(ctx context.Context) (bool, string) {
		pods, err := multiregPods(ctx)
		if err != nil {
			return false, err.Error()
		}
		var states []string
		for _, p := range pods {
			states = append(states, podState(p))
		}
		return len(pods) == 0, fmt.Sprint(states)
	})
}

// waitCSINode waits until CSINode lists exactly want (name → node ID).
func waitCSINode(t *testing.T, want map[string]string, d time.Duration) time.Duration {
	t.Helper()
	return waitUntil(t, d, fmt.Sprintf("CSINode = %v", want), func(ctx context.Context) (bool, string) {
		drivers, err := csiNodeDrivers(ctx)
		if err != nil {
			return false, err.Error()
		}
		if len(drivers) != len(want) {
			return false, fmt.Sprint(drivers)
		}
		for n, id := range want {
			if drivers[n] != id {
				return false, fmt.Sprint(drivers)
			}
		}
		return true, ""
	})
}

// csiNodeWatch records, from a watch on the node's CSINode, how long each driver was missing.
type csiNodeWatch struct {
	cancel context.CancelFunc
	done   chan struct{}
	mu     sync.Mutex
	gone   map[string]time.Time // driver → when it left, while it is missing
	gaps   map[string][]time.Duration
	rv     uint64 // resource version of the last object delivered
	err    error
}

func watchCSINode(t *testing.T) *csiNodeWatch {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	w := &csiNodeWatch{cancel: cancel, done: make(chan struct{}), gone: map[string]time.Time{}, gaps: map[string][]time.Duration{}}
	initial, err := cl.Client.StorageV1().CSINodes().Get(ctx, cluster.NodeName, metav1.GetOptions{})
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	w.rv, _ = strconv.ParseUint(initial.ResourceVersion, 10, 64)
	known := map[string]bool{}
	for _, d := range initial.Spec.Drivers {
		known[d.Name] = true
	}
	wi, err := cl.Client.StorageV1().CSINodes().Watch(ctx, metav1.ListOptions{
		FieldSelector:   fields.OneTermEqualSelector("metadata.name", cluster.NodeName).String(),
		ResourceVersion: initial.ResourceVersion,
	})
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	go func() {
		defer close(w.done)
		defer wi.Stop()
		for {
			var ev watch.Event
			select {
			case <-ctx.Done():
				return
			case e, ok := <-wi.ResultChan():
				if !ok {
					w.mu.Lock()
					w.err = errors.New("CSINode watch closed by the API server before the rollout ended")
					w.mu.Unlock()
					return
				}
				ev = e
			}
			if ev.Type == watch.Error {
				w.mu.Lock()
				w.err = fmt.Errorf("CSINode watch: %v", ev.Object)
				w.mu.Unlock()
				return
			}
			n, ok := ev.Object.(*storagev1.CSINode)
			if !ok {
				continue
			}
			now := time.Now()
			present := map[string]bool{}
			for _, d := range n.Spec.Drivers {
				present[d.Name] = true
			}
			w.mu.Lock()
			if rv, err := strconv.ParseUint(n.ResourceVersion, 10, 64); err == nil {
				w.rv = rv
			}
			for name := range known {
				since, missing := w.gone[name]
				switch {
				case !present[name] && !missing:
					w.gone[name] = now
				case present[name] && missing:
					w.gaps[name] = append(w.gaps[name], now.Sub(since))
					delete(w.gone, name)
				}
			}
			w.mu.Unlock()
		}
	}()
	t.Cleanup(func() { w.cancel(); <-w.done })
	return w
}

// progress returns the resource version of the last CSINode the watch delivered and the
// drivers missing from it.
func (w *csiNodeWatch) progress() (uint64, []string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	var names []string
	for n := range w.gone {
		names = append(names, n)
	}
	sort.Strings(names)
	return w.rv, names
}

// stop ends the watch and returns the gaps (a driver still missing counts until now), or the
// watch's error: a watch that ended early saw only part of the rollout.
func (w *csiNodeWatch) stop() (map[string][]time.Duration, error) {
	w.cancel()
	<-w.done
	w.mu.Lock()
	defer w.mu.Unlock()
	out := map[string][]time.Duration{}
	for n, g := range w.gaps {
		out[n] = append([]time.Duration(nil), g...)
	}
	names := make([]string, 0, len(w.gone))
	for n := range w.gone {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		out[n] = append(out[n], time.Since(w.gone[n]))
	}
	return out, w.err
}
