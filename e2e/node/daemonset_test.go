package node_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
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

	"github.com/google/go-containerregistry/pkg/name"

	"multireg.dev/multireg/e2e/node/cluster"
	"multireg.dev/multireg/e2e/node/endpoints"
)

// The DaemonSet scenarios' drivers: three CSI drivers, a device plugin and a DRA driver, and
// one more that never runs on this node.
const (
	csiD     = "delta.csi.multireg.test"
	csiE     = "epsilon.csi.multireg.test" // its endpoint is edited in the ConfigMap
	csiZ     = "zeta.csi.multireg.test"
	gadget   = "example.com/gadget"
	nGadgets = 2
	draDS    = "dra.ds.multireg.test"
	// absentDRA is configured, but never runs on this node: a fleet's drivers file lists the
	// drivers of every node pool. The pod must be Ready anyway.
	absentDRA = "gpu.absent.multireg.test"
)

// dsDrivers are the drivers the DaemonSet registers on this node.
var dsDrivers = []string{csiD, csiE, csiZ, gadget, draDS}

// dsEnv is what the DaemonSet scenarios share: the drivers' endpoints, and the directory of the
// kustomize overlay over the shipped examples.
type dsEnv struct {
	csi     map[string]*endpoints.CSI // by driver name; "epsilon-v2" is csiE at its new endpoint
	epsilon string                    // the key of csiE's endpoint in csi: the one the ConfigMap names
	dp      *endpoints.DevicePlugin
	dra     *endpoints.DRA
	dir     string // base/ and overlay/ of writeOverlay
}

// newDSEnv starts the DaemonSet scenarios' endpoints; the test's cleanup deletes what the
// overlay applied, waits for the pods to be gone, and stops the endpoints.
func newDSEnv(t *testing.T) *dsEnv {
	t.Helper()
	e := &dsEnv{csi: map[string]*endpoints.CSI{}, epsilon: csiE, dir: filepath.Join(tempDir(t), "manifests")}
	for _, c := range []struct{ key, name, dir, nodeID string }{
		{csiD, csiD, "delta", "delta-node-1"}, {csiE, csiE, "epsilon", "epsilon-node-1"},
		// the same driver at a new endpoint, answering another node ID
		{"epsilon-v2", csiE, "epsilon-v2", "epsilon-node-2"}, {csiZ, csiZ, "zeta", "zeta-node-1"},
	} {
		ep, err := endpoints.StartCSI(endpointPath(c.dir, "csi.sock"), endpoints.CSIOptions{Name: c.name, NodeID: c.nodeID})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(ep.Stop)
		e.csi[c.key] = ep
	}
	var err error
	if e.dp, err = endpoints.StartDevicePlugin(endpointPath("gadget", "dp.sock"), endpoints.DeviceOptions{ResourceName: gadget, Devices: nGadgets}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.dp.Stop)
	if e.dra, err = endpoints.StartDRA(endpointPath("dra-ds", "dra.sock"), endpoints.DRAOptions{DriverName: draDS}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.dra.Stop)
	t.Cleanup(func() {
		if _, err := os.Stat(e.overlay()); os.IsNotExist(err) {
			return // nothing applied
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		if out, err := cl.Kubectl(ctx, "delete", "-k", e.overlay(), "--wait=true", "--timeout=90s"); err != nil {
			t.Errorf("%v\n%s", err, out)
		}
		waitNoPods(t)
	})
	return e
}

func (e *dsEnv) overlay() string { return filepath.Join(e.dir, "overlay") }

// apply writes the overlay, with csiE at its current endpoint and the multireg image ref, and
// applies it with `kubectl apply -k`.
func (e *dsEnv) apply(t *testing.T, image string) {
	t.Helper()
	writeOverlay(t, e.dir, e.csi[e.epsilon].Path(), image)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if out, err := cl.Kubectl(ctx, "apply", "-k", e.overlay()); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
}

// csiNode is what CSINode must list: each CSI driver with the node ID its current endpoint
// answers.
func (e *dsEnv) csiNode() map[string]string {
	want := map[string]string{csiD: "delta-node-1", csiE: "epsilon-node-1", csiZ: "zeta-node-1"}
	if e.epsilon == "epsilon-v2" {
		want[csiE] = "epsilon-node-2"
	}
	return want
}

// dsCounts are what kubelet asked the endpoints the ConfigMap names: a CSI driver's
// NodeGetInfo is called at each registration, a device plugin's ListAndWatch opened at each,
// and kubelet's DRA manager connects at each.
type dsCounts struct {
	nodeGetInfoD, nodeGetInfoE, nodeGetInfoZ int
	listAndWatchOpened, listAndWatchOpen     int
	draConnections                           int
}

func (c dsCounts) String() string {
	return fmt.Sprintf("NodeGetInfo %s %d, %s %d, %s %d; ListAndWatch %d opened, %d open; DRA connections %d",
		csiD, c.nodeGetInfoD, csiE, c.nodeGetInfoE, csiZ, c.nodeGetInfoZ, c.listAndWatchOpened, c.listAndWatchOpen, c.draConnections)
}

func (e *dsEnv) counts() dsCounts {
	var c dsCounts
	c.nodeGetInfoD, _ = e.csi[csiD].NodeGetInfoCalls()
	c.nodeGetInfoE, _ = e.csi[e.epsilon].NodeGetInfoCalls()
	c.nodeGetInfoZ, _ = e.csi[csiZ].NodeGetInfoCalls()
	c.listAndWatchOpened, c.listAndWatchOpen = e.dp.ListAndWatchStreams()
	c.draConnections = e.dra.Connections()
	return c
}

// waitNode waits until the node shows every driver: CSINode, the gadgets' capacity and
// allocatable, kubelet's DRA manager connected, and kubelet's plugin manager holding every
// driver's socket (as the /status of the pod at url names them).
func (e *dsEnv) waitNode(t *testing.T, who, url string) map[string]driverStatus {
	t.Helper()
	waitCSINode(t, e.csiNode(), 60*time.Second)
	waitUntil(t, 60*time.Second, "node capacity "+gadget, func(ctx context.Context) (bool, string) {
		c, a, err := capacity(ctx, gadget)
		if err != nil {
			return false, err.Error()
		}
		return c == nGadgets && a == nGadgets, fmt.Sprintf("capacity %d, allocatable %d", c, a)
	})
	waitUntil(t, 30*time.Second, "kubelet's DRA manager connects to "+draDS, func(context.Context) (bool, string) {
		return e.dra.Connections() > 0, "no connection yet"
	})
	st := waitRegisteredAt(t, who, url, dsDrivers...)
	waitKubeletHolds(t, dsDrivers...)
	return st
}

// 5. The shipped examples/ (DaemonSet + kustomization, copied verbatim) through a kustomize
// overlay that points the host paths at the test kubelet's root, the config at the test's
// drivers and the image at the one `make image` built, pinned by its digest in the test's
// registry (kustomize's `digest:`, as docs/deploy.md pins a release), applied with `kubectl
// apply -k`:
//   - kubelet pulls the image by digest from the registry (IfNotPresent, as shipped) and the
//     container runs exactly that image index (assertRuns);
//   - multireg runs as a pod, Ready and its rollout complete although a configured DRA
//     driver never runs on this node, and its drivers appear in CSINode;
//   - an edited ConfigMap, applied again, reaches multireg through kubelet's own volume
//     update and changes CSINode for the edited driver only (same pod, other sockets and
//     endpoints untouched);
//   - `kubectl rollout restart` with the shipped surge: the new pod runs the same image, found
//     on the node (the registry is not asked), takes the old one's sockets over and kubelet
//     sees nothing at all (rolloutRestart).
func scenarioDaemonSet(t *testing.T, env *dsEnv) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()

	// Apply as shipped, the image pinned by digest.
	start := time.Now()
	mark := markRegistry()
	env.apply(t, underTest.ByDigest())
	pod := waitPodReady(t, 3*time.Minute, "")
	t.Logf("multireg pod %s Ready %.1fs after kubectl apply -k (image %s)", pod.Name, time.Since(start).Seconds(), underTest.ByDigest())
	figures = append(figures, "DaemonSet by digest: "+assertRuns(t, pod.Name, underTest, underTest.ByDigest(), fetched, mark))
	// What a user waits on after an apply: the rollout completes, the absent driver
	// notwithstanding.
	if out, err := cl.Kubectl(ctx, "rollout", "status", "-n", "kube-system", "daemonset/multireg", "--timeout=1m"); err != nil {
		t.Fatalf("kubectl rollout status after kubectl apply -k, with %s configured and absent: %v\n%s", absentDRA, err, out)
	}
	env.waitNode(t, "multireg in pod "+pod.Name, podStatusURL(pod))
	t.Logf("CSINode lists %s, %s, %s, and %d %s are allocatable, %.1fs after kubectl apply -k", csiD, csiE, csiZ, nGadgets, gadget, time.Since(start).Seconds())
	if out, err := cl.Kubectl(ctx, "exec", "-n", "kube-system", pod.Name, "--", "/multireg", "status"); err != nil {
		t.Errorf("multireg status inside the pod: %v", err)
	} else {
		t.Logf("kubectl exec %s -- /multireg status:\n%s", pod.Name, out)
		for _, n := range dsDrivers {
			if !strings.Contains(out, n) {
				t.Errorf("multireg status inside the pod does not list %s", n)
			}
		}
		if !strings.Contains(out, "5 of 6 drivers registered, 1 absent from this node") || !regexp.MustCompile(regexp.QuoteMeta(absentDRA)+`\s+DRAPlugin\s+Absent`).MatchString(out) {
			t.Errorf("multireg status inside the pod does not show %s absent", absentDRA)
		}
	}

	// Edit the ConfigMap: epsilon moves to its new endpoint.
	unchanged := []string{csiD, csiZ}
	podBefore := waitRegisteredAt(t, "multireg in pod "+pod.Name, podStatusURL(pod), csiD, csiE, csiZ)
	socks := idents(t, unchanged...)
	dOK, _ := env.csi[csiD].NodeGetInfoCalls()
	zOK, _ := env.csi[csiZ].NodeGetInfoCalls()
	env.epsilon = "epsilon-v2"
	start = time.Now()
	env.apply(t, underTest.ByDigest())
	d := waitCSINode(t, env.csiNode(), 60*time.Second)
	t.Logf("ConfigMap edit → CSINode shows %s's new node ID: %.1fs (kubelet's volume update + multireg's reload + kubelet's registration)", csiE, d.Seconds())
	figures = append(figures, fmt.Sprintf("ConfigMap edit applied → CSINode updated: %.1fs (kubelet syncFrequency 1s)", d.Seconds()))
	// Only epsilon moved, judged over a few reconcile passes: the other two were not
	// registered again nor their sockets published again, and multireg was not restarted.
	stays(t, 2500*time.Millisecond, "the edit touches only "+csiE, func(ctx context.Context) (string, error) {
		if d2, _ := env.csi[csiD].NodeGetInfoCalls(); d2 != dOK {
			return fmt.Sprintf("%s registered again (NodeGetInfo %d → %d)", csiD, dOK, d2), nil
		}
		if z2, _ := env.csi[csiZ].NodeGetInfoCalls(); z2 != zOK {
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

	rolloutRestart(t, env, pod)
}

// rolloutRestart is scenario 5's end: `kubectl rollout restart` of the shipped DaemonSet, which
// surges: the new pod asks the old one for a hand-over and serves the very sockets the old one
// served. kubelet must see nothing at all, looked at while the rollout runs and for a few
// reconcile passes after: no CSINode update touching the drivers, the gadgets' capacity and
// allocatable at every look, every socket held by kubelet's plugin manager at every look and
// nothing in its log about them, no endpoint asked again (NodeGetInfo, ListAndWatch, DRA
// connection), the same socket files. The old pod hands over and exits when deleted; the new
// one serves every socket it was handed, each driver's loop where the old one's stood.
func rolloutRestart(t *testing.T, env *dsEnv, pod corev1.Pod) {
	before := waitRegisteredAt(t, "multireg in pod "+pod.Name, podStatusURL(pod), dsDrivers...)
	socks := idents(t, dsDrivers...)
	counts := env.counts()
	logFrom := kubeletLogSize(t)
	w := watchCSINode(t)
	mark := markRegistry()

	r := followRollout(t, pod, "rollout", "restart", "-n", "kube-system", "daemonset/multireg")
	assertRuns(t, r.pod.Name, underTest, underTest.ByDigest(), present, mark)
	stays(t, 2500*time.Millisecond, "kubelet sees nothing after the hand-over", func(ctx context.Context) (string, error) {
		if now := env.counts(); now != counts {
			return fmt.Sprintf("the endpoints were asked again: %v; before: %v", now, counts), nil
		}
		if c, a, err := capacity(ctx, gadget); err != nil {
			return "", err
		} else if c != nGadgets || a != nGadgets {
			return fmt.Sprintf("%s capacity %d, allocatable %d", gadget, c, a), nil
		}
		held, err := kubeletRegistered(ctx)
		if err != nil {
			return "", err
		}
		for _, n := range dsDrivers {
			if !held[socketOf(t, n)] {
				return "kubelet's plugin manager no longer holds " + n, nil
			}
		}
		return "", nil
	})
	gaps := w.catchUp(t)
	events := pluginManagerEvents(t, logFrom, dsDrivers...)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	inst, st, err := statusDocAt(ctx, podStatusURL(r.pod))
	if err != nil {
		t.Fatal(err)
	}

	line := r.report(t, "rollout restart (surge, hand-over)")
	longest := reportGaps(t, "rollout restart", gaps)
	updates, noticed := w.driverUpdates(), 0
	for _, lines := range events {
		noticed += len(lines)
	}
	t.Logf("  CSINode: %d update(s) of the drivers, longest absence %s; endpoints: %v (before: %v); kubelet's plugin manager logged %d line(s) about the sockets",
		updates, longest.Round(time.Millisecond), env.counts(), counts, noticed)
	t.Logf("  new pod's /status instance: %+v", inst)
	figures = append(figures, line,
		fmt.Sprintf("rollout restart (surge, hand-over): CSINode updates touching the drivers: %d, longest absence %s; kubelet's plugin manager: %d log lines about the sockets; endpoints asked again: %v",
			updates, longest.Round(time.Millisecond), noticed, env.counts() != counts))

	if updates != 0 || longest != 0 {
		t.Errorf("CSINode changed during the hand-over: %d update(s) of the drivers, gaps %v", updates, gaps)
	}
	for _, n := range dsDrivers {
		for _, l := range events[n] {
			t.Errorf("kubelet's plugin manager noticed %s's socket during the hand-over: %s", n, l)
		}
		if r.notHeld[n] > 0 {
			t.Errorf("kubelet's plugin manager did not hold %s's socket at %d of %d looks", n, r.notHeld[n], r.heldAt)
		}
	}
	if len(r.gadgets) != 1 || r.gadgets[fmt.Sprintf("%d/%d", nGadgets, nGadgets)] == 0 {
		t.Errorf("%s capacity/allocatable moved during the hand-over: %v (looks by what they saw)", gadget, r.gadgets)
	}
	assertSame(t, "registration sockets across the hand-over", socks, idents(t, dsDrivers...))
	// The two pods: the old one handed over and exited cleanly when deleted; the new one was
	// handed every socket and was never a standby.
	if !strings.Contains(r.oldLog, msgHanded) || !strings.Contains(r.oldLog, msgStopped) {
		t.Errorf("the old pod %s's log does not say it handed over (%q) and stopped (%q):\n%s", pod.Name, msgHanded, msgStopped, r.oldLog)
	}
	newLog, err := cl.Kubectl(ctx, "logs", "-n", "kube-system", r.pod.Name)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("  the old pod's log:\n%s\n  the new pod's log:\n%s",
		strings.Join(linesWith(r.oldLog, "hand", msgStopped), "\n"), strings.Join(linesWith(newLog, "took over", "serving the registration directory"), "\n"))
	if !strings.Contains(newLog, msgTookOver) || strings.Contains(newLog, msgStandby) {
		t.Errorf("the new pod %s's log does not say it took over (%q) without standing by:\n%s", r.pod.Name, msgTookOver, newLog)
	}
	if slices.Contains(r.roles[r.pod.Name], "standby") || slices.Contains(r.roles[pod.Name], "standby") {
		t.Errorf("a pod was seen in standby: the hand-over did not happen (roles: %v)", r.roles)
	}
	if inst.Role != "serving" || inst.Inherited != len(dsDrivers) {
		t.Errorf("the new pod's /status instance: %+v; want serving, %d sockets inherited", inst, len(dsDrivers))
	}
	for _, n := range dsDrivers {
		if st[n].Phase != "Registered" || st[n].Attempts != before[n].Attempts || st[n].Failures != before[n].Failures {
			t.Errorf("%s in the new pod: %+v; before, in the old pod: %+v", n, st[n], before[n])
		}
	}
}

// podStatusURL is multireg's /status in pod, reached on the pod's IP (the DaemonSet serves
// HTTP on :9809).
func podStatusURL(pod corev1.Pod) string {
	return fmt.Sprintf("http://%s:9809/status", pod.Status.PodIP)
}

// writeOverlay writes DIR/base (the shipped examples, verbatim) and DIR/overlay (the test's
// drivers file, the image — REGISTRY/NAME:TAG or REGISTRY/NAME@sha256:… —, and host paths
// under the test kubelet's root).
func writeOverlay(t *testing.T, dir, epsilonEndpoint, image string) {
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
    type: DevicePlugin
    endpoint: %s
  - name: %s
    type: DRAPlugin
    endpoint: %s
  - name: %s
    type: DRAPlugin
    endpoint: %s
`, cl.PluginsRegistry, csiD, endpointPath("delta", "csi.sock"), csiE, epsilonEndpoint, csiZ, endpointPath("zeta", "csi.sock"),
		gadget, endpointPath("gadget", "dp.sock"), draDS, endpointPath("dra-ds", "dra.sock"), absentDRA, endpointPath("absent-gpu", "dra.sock"))
	// kustomize's images transformer: newName and newTag, or newName and digest.
	ref, err := name.ParseReference(image, name.StrictValidation)
	if err != nil {
		t.Fatalf("image %q: %v", image, err)
	}
	// Quoted: a tag such as 4465133 is a number to YAML.
	newImage := fmt.Sprintf("newName: %q\n    ", ref.Context().Name())
	switch r := ref.(type) {
	case name.Tag:
		newImage += fmt.Sprintf("newTag: %q", r.TagStr())
	case name.Digest:
		newImage += fmt.Sprintf("digest: %q", r.DigestStr())
	}
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
  - name: ghcr.io/multireg/multireg
    %[1]s
patches:
  - target:
      kind: DaemonSet
      name: multireg
    patch: |-
      - {op: test, path: /spec/template/spec/volumes/0/name, value: registration-dir}
      - {op: replace, path: /spec/template/spec/volumes/0/hostPath/path, value: %[2]s}
      - {op: test, path: /spec/template/spec/volumes/1/name, value: plugins-dir}
      - {op: replace, path: /spec/template/spec/volumes/1/hostPath/path, value: %[3]s}
      - {op: test, path: /spec/template/spec/containers/0/volumeMounts/0/name, value: registration-dir}
      - {op: replace, path: /spec/template/spec/containers/0/volumeMounts/0/mountPath, value: %[2]s}
      - {op: test, path: /spec/template/spec/containers/0/volumeMounts/1/name, value: plugins-dir}
      - {op: replace, path: /spec/template/spec/containers/0/volumeMounts/1/mountPath, value: %[3]s}
      - {op: test, path: /spec/template/spec/volumes/2/name, value: pod-resources}
      - {op: replace, path: /spec/template/spec/volumes/2/hostPath/path, value: %[4]s}
      - {op: test, path: /spec/template/spec/containers/0/volumeMounts/2/name, value: pod-resources}
      - {op: replace, path: /spec/template/spec/containers/0/volumeMounts/2/mountPath, value: %[4]s}
`, newImage, cl.PluginsRegistry, cl.PluginsDir, filepath.Join(cl.KubeletRoot, "pod-resources"))
	for name, content := range map[string]string{"config.yaml": config, "kustomization.yaml": kustomization} {
		if err := os.WriteFile(filepath.Join(overlay, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
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

// csiNodeWatch records, from a watch on the node's CSINode, how long each driver was missing,
// and how many updates changed the drivers' list in any way.
type csiNodeWatch struct {
	cancel  context.CancelFunc
	done    chan struct{}
	mu      sync.Mutex
	gone    map[string]time.Time // driver → when it left, while it is missing
	gaps    map[string][]time.Duration
	rv      uint64 // resource version of the last object delivered
	drivers []storagev1.CSINodeDriver
	updates int // objects delivered whose drivers differ from the previous ones'
	err     error
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
	w.drivers = initial.Spec.Drivers
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
			if !reflect.DeepEqual(n.Spec.Drivers, w.drivers) {
				w.updates++
			}
			w.drivers = n.Spec.Drivers
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

// catchUp waits until the watch has delivered the CSINode the API server holds now (its
// resource version, at least) with every driver present, and stops it (stop).
func (w *csiNodeWatch) catchUp(t *testing.T) map[string][]time.Duration {
	t.Helper()
	final, err := cl.Client.StorageV1().CSINodes().Get(context.Background(), cluster.NodeName, metav1.GetOptions{})
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
	return gaps
}

// driverUpdates returns how many CSINode updates the watch saw that changed the drivers.
func (w *csiNodeWatch) driverUpdates() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.updates
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
