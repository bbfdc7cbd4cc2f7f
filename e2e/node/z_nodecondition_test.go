package node_test

// This file's name begins with z_ so that TestNodeCondition is the package's last test: Go runs
// a package's tests in the order of their files' names, and this one re-registers the node,
// restarts kubelet and stops the API server.

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/cli"
	authenticationv1 "k8s.io/api/authentication/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"multireg.dev/multireg/e2e/node/cluster"
	"multireg.dev/multireg/e2e/node/endpoints"
)

// The node condition's scenarios: multireg installed with the chart (helm's library, as
// `helm install` runs it), the condition on, a startup taint, and required drivers of each
// kind, each a real endpoint that kubelet's own handler talks to.
const (
	ncType     = "multireg.dev/PluginsRegistered"
	ncTaint    = "multireg.dev/plugins-not-ready:NoSchedule"
	ncTaintKey = "multireg.dev/plugins-not-ready"
	ncCSI      = "alpha.nc.multireg.test"    // required; its endpoint starts last (12), is rejected (13), loses its socket and its endpoint (14)
	ncDP       = "example.com/nc-widget"     // required
	ncDRA      = "dra.nc.multireg.test"      // required from 16 on, started while the API server is down
	ncOptional = "optional.nc.multireg.test" // not required, never on this node: never named
	ncRelease  = "multireg"
	ncNS       = "kube-system"
	ncWorkload = "nc-workload"
	ncOther    = "nc-other" // 15: a second Node, for the admission policy
	nNCWidgets = 2
	ncNodeID   = "nc-alpha-node-1" // what ncCSI's NodeGetInfo answers
	// ncBound is the most a change kubelet makes or sees may take to show in the condition:
	// multireg writes 250 ms to 1 s after it sees a change (docs/node-condition.md), plus an
	// API round trip, with room for this loaded 2-core machine. The figures logged are what
	// the scenarios measured.
	ncBound = 2 * time.Second
)

// ncEnv is what the node-condition scenarios share.
type ncEnv struct {
	csi *endpoints.CSI // nil until scenario 12 starts it
	dp  *endpoints.DevicePlugin
	dra *endpoints.DRA // nil until scenario 16 starts it
	// installed: the release is there (its cleanup uninstalls it); withDRA: its values name
	// the DRA driver.
	installed, withDRA bool
}

// TestNodeCondition deploys multireg with the node condition on, as the chart does by default
// (helm install: the ClusterRole, the ValidatingAdmissionPolicy, the DaemonSet's arguments),
// with a startup taint, and proves on the real node: the condition goes True once kubelet
// holds every required driver, and the startup taint goes then, and only then does a pod that
// tolerates nothing get scheduled (12); kubelet's rejection of a required CSI driver (13), its
// registration socket removed and its endpoint gone (14) each make it False within ncBound,
// naming the driver; the admission policy confines the pod's token to its own node (15); an
// API server stopped for 30 s stops no registration, and the condition is right again within
// seconds of its return (16); the uninstall as docs/deploy.md has it takes every registration
// socket away, and what the node's condition says after is reported (17).
func TestNodeCondition(t *testing.T) {
	e := &ncEnv{}
	var err error
	if e.dp, err = endpoints.StartDevicePlugin(endpointPath("nc-widget", "dp.sock"), endpoints.DeviceOptions{ResourceName: ncDP, Devices: nNCWidgets}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.dp.Stop)
	t.Cleanup(func() {
		if e.csi != nil {
			e.csi.Stop()
		}
		if e.dra != nil {
			e.dra.Stop()
		}
	})
	t.Cleanup(func() { e.uninstall(t, false) })
	_ = scenario(t, "12-startup-taint-condition-true", func(t *testing.T) { e.startupTaint(t) }) &&
		scenario(t, "13-kubelet-rejects-a-required-csi-driver", func(t *testing.T) { e.rejected(t) }) &&
		scenario(t, "14-registration-socket-removed-endpoint-gone", func(t *testing.T) { e.socketAndEndpoint(t) }) &&
		scenario(t, "15-admission-policy", func(t *testing.T) { e.admissionPolicy(t) }) &&
		scenario(t, "16-api-server-stopped-30s", func(t *testing.T) { e.apiServerStopped(t) }) &&
		scenario(t, "17-uninstall", func(t *testing.T) { e.uninstall(t, true) })
	for _, g := range []struct {
		what string
		ncGap
	}{{ncCSI + " out of CSINode", ncGaps.csi}, {ncDP + " allocatable short", ncGaps.alloc}} {
		if g.scenario == "" {
			figures = append(figures, fmt.Sprintf("node condition scenarios: %s: never", g.what))
			continue
		}
		figures = append(figures, fmt.Sprintf("node condition scenarios: the longest time %s: %dms, in scenario %s", g.what, ms(g.longest), g.scenario))
	}
}

// values are the chart's values of the scenarios: the node's kubelet root and drivers (the
// DRA driver with withDRA), the image `make image` built (by its index digest in the test's
// registry), a short backoff, the startup taint, and where the pods reach the API server.
// This node runs no kube-proxy, so the kubernetes Service's address leads nowhere from a pod:
// KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT name the API server's address on the
// pods' network, as node agents of clusters without kube-proxy are configured (the chart's
// env). Everything else is the chart's default: the node condition on, its ClusterRole and
// ValidatingAdmissionPolicy, pod-resources read.
func (e *ncEnv) values(cleanup bool) map[string]any {
	host, port := cl.PodAPIServer()
	driver := func(name, typ, endpoint string, required bool) map[string]any {
		d := map[string]any{"name": name, "type": typ, "endpoint": endpoint}
		if required {
			d["required"] = true
		}
		return d
	}
	drivers := []any{
		driver(ncCSI, "CSIPlugin", endpointPath("nc-alpha", "csi.sock"), true),
		driver(ncDP, "DevicePlugin", endpointPath("nc-widget", "dp.sock"), true),
		driver(ncOptional, "CSIPlugin", endpointPath("nc-optional", "csi.sock"), false),
	}
	if e.withDRA {
		drivers = append(drivers, driver(ncDRA, "DRAPlugin", endpointPath("nc-dra", "dra.sock"), true))
	}
	return map[string]any{
		"kubeletDir": cl.KubeletRoot,
		"image":      map[string]any{"repository": underTest.Repo, "digest": underTest.Digest.String()},
		"defaults":   map[string]any{"backoff": map[string]any{"initialInterval": "500ms", "maxInterval": "2s"}},
		"drivers":    drivers,
		"nodeCondition": map[string]any{
			"startupTaint": ncTaint,
		},
		"env": []any{
			map[string]any{"name": "KUBERNETES_SERVICE_HOST", "value": host},
			map[string]any{"name": "KUBERNETES_SERVICE_PORT", "value": strconv.Itoa(port)},
		},
		"cleanupOnExit": cleanup,
	}
}

// helmConfig is Helm's action configuration for the release's namespace, on the cluster.
func helmConfig(t *testing.T) *action.Configuration {
	t.Helper()
	settings := cli.New()
	settings.KubeConfig = cl.Kubeconfig
	settings.SetNamespace(ncNS)
	cfg := new(action.Configuration)
	if err := cfg.Init(settings.RESTClientGetter(), ncNS, "secret", func(format string, v ...any) { t.Logf("helm: "+format, v...) }); err != nil {
		t.Fatal(err)
	}
	return cfg
}

// helm installs the chart (install) or upgrades the release to values.
func (e *ncEnv) helm(t *testing.T, install bool, vals map[string]any) {
	t.Helper()
	ch, err := loader.Load(filepath.Join(repoRoot(t), "charts", "multireg"))
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if install {
		in := action.NewInstall(helmConfig(t))
		in.ReleaseName, in.Namespace, in.Timeout = ncRelease, ncNS, 2*time.Minute
		rel, err := in.Run(ch, vals)
		if err != nil {
			t.Fatalf("helm install: %v", err)
		}
		e.installed = true
		t.Logf("helm install %s: revision %d %s (%dms)", rel.Name, rel.Version, rel.Info.Status, time.Since(start).Milliseconds())
		return
	}
	up := action.NewUpgrade(helmConfig(t))
	up.Namespace, up.Timeout = ncNS, 2*time.Minute
	rel, err := up.Run(ncRelease, ch, vals)
	if err != nil {
		t.Fatalf("helm upgrade: %v", err)
	}
	t.Logf("helm upgrade %s: revision %d %s (%dms)", rel.Name, rel.Version, rel.Info.Status, time.Since(start).Milliseconds())
}

// ncCondition returns multireg's condition of n, nil if it has none.
func ncCondition(n *corev1.Node) *corev1.NodeCondition {
	for i := range n.Status.Conditions {
		if string(n.Status.Conditions[i].Type) == ncType {
			return &n.Status.Conditions[i]
		}
	}
	return nil
}

// condIs holds for a Node event whose multireg condition has status and whose message says
// each of says.
func condIs(status corev1.ConditionStatus, says ...string) func(tlEvent) bool {
	return func(e tlEvent) bool {
		if e.node == nil {
			return false
		}
		c := ncCondition(e.node)
		if c == nil || c.Status != status {
			return false
		}
		for _, s := range says {
			if !strings.Contains(c.Message, s) {
				return false
			}
		}
		return true
	}
}

func hasStartupTaint(n *corev1.Node) bool {
	for _, tn := range n.Spec.Taints {
		if tn.Key == ncTaintKey && tn.Effect == corev1.TaintEffectNoSchedule {
			return true
		}
	}
	return false
}

func podScheduled(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodScheduled {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

func listsDriver(e tlEvent, name string) bool {
	if e.csi == nil {
		return false
	}
	for _, d := range e.csi.Spec.Drivers {
		if d.Name == name {
			return true
		}
	}
	return false
}

// isCSINode and isNode select a timeline's CSINode and Node events.
func isCSINode(e tlEvent) bool { return e.csi != nil }
func isNode(e tlEvent) bool    { return e.node != nil }

// widgetsAllocatable holds for a Node event whose allocatable shows every widget of ncDP.
func widgetsAllocatable(e tlEvent) bool {
	q, ok := e.node.Status.Allocatable[corev1.ResourceName(ncDP)]
	return ok && q.Value() == nNCWidgets
}

// ncGap is the longest absence of one kind that a scenario saw, for the summary.
type ncGap struct {
	scenario string
	gap
}

// ncGaps are the longest absences the node-condition scenarios saw: ncCSI out of CSINode, and
// ncDP's widgets short of allocatable.
var ncGaps struct{ csi, alloc ncGap }

// noteGaps logs what tl showed, in [from, to), of ncCSI in CSINode and of ncDP's widgets in the
// node's allocatable, and keeps the longest for the summary; why says what the scenario did
// to them.
func noteGaps(t *testing.T, tl *timeline, scenario, why string, from, to time.Time) (csi, alloc gap) {
	t.Helper()
	csi = tl.gaps(from, to, isCSINode, func(e tlEvent) bool { return listsDriver(e, ncCSI) })
	alloc = tl.gaps(from, to, isNode, widgetsAllocatable)
	t.Logf("%s (%s): %s out of CSINode %s; %s allocatable short %s", scenario, why, ncCSI, csi, ncDP, alloc)
	if csi.longest > ncGaps.csi.longest {
		ncGaps.csi = ncGap{scenario + " (" + why + ")", csi}
	}
	if alloc.longest > ncGaps.alloc.longest {
		ncGaps.alloc = ncGap{scenario + " (" + why + ")", alloc}
	}
	return csi, alloc
}

// ms is d in ms, for the figures.
func ms(d time.Duration) int64 { return d.Milliseconds() }

// multiregPod waits until the release's one pod runs (Ready or not: it is not Ready while a
// required driver is missing) and returns it.
func multiregPod(t *testing.T) corev1.Pod {
	t.Helper()
	var pod corev1.Pod
	waitUntil(t, 3*time.Minute, "the multireg pod running", func(ctx context.Context) (bool, string) {
		pods, err := multiregPods(ctx)
		if err != nil {
			return false, err.Error()
		}
		var states []string
		for _, p := range pods {
			states = append(states, podState(p))
			if len(pods) == 1 && p.DeletionTimestamp == nil && p.Status.Phase == corev1.PodRunning && p.Status.PodIP != "" {
				pod = p
				return true, ""
			}
		}
		return false, fmt.Sprint(states)
	})
	return pod
}

// noteSockets records the registration sockets the pod's /status names (socketOf).
func noteSockets(t *testing.T, pod corev1.Pod, names ...string) map[string]driverStatus {
	t.Helper()
	return waitRegisteredAt(t, "multireg in pod "+pod.Name, podStatusURL(pod), names...)
}

// podLog is the multireg pod's log.
func podLog(t *testing.T, pod corev1.Pod) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := cl.Kubectl(ctx, "logs", "-n", ncNS, pod.Name)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// 12. The node joins anew with the startup taint (kubelet's --register-with-taints), a pod that
// tolerates nothing waits for it, and the chart is installed with the taint's removal on and
// every driver but the required CSI driver running: the condition is False naming that driver
// (and no other). Its endpoint starts: kubelet registers it (CSINode lists it), the condition
// is True (measured from the listing), multireg removes the taint (measured from the True),
// and only then is the pod scheduled (measured from the removal; resource versions prove the
// order).
func (e *ncEnv) startupTaint(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	waitUntil(t, 2*time.Minute, "no pod left on the node (the earlier tests' cleanups)", func(ctx context.Context) (bool, string) {
		pods, err := cl.Client.CoreV1().Pods(metav1.NamespaceAll).List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + cluster.NodeName})
		if err != nil {
			return false, err.Error()
		}
		var names []string
		for _, p := range pods.Items {
			names = append(names, p.Namespace+"/"+p.Name)
		}
		return len(names) == 0, fmt.Sprint(names)
	})
	start := time.Now()
	if err := cl.RegisterNodeAgain(ctx, ncTaint); err != nil {
		t.Fatal(err)
	}
	node, err := cl.Client.CoreV1().Nodes().Get(ctx, cluster.NodeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("the node joined anew (kubelet --register-with-taints=%s) and is Ready %dms after kubelet stopped; its taints: %v", ncTaint, ms(time.Since(start)), node.Spec.Taints)
	if !hasStartupTaint(node) {
		t.Fatalf("kubelet registered the node without the startup taint: %v", node.Spec.Taints)
	}
	// The API server's own not-ready taint goes once the node is Ready (the node lifecycle
	// controller): then the startup taint is all that keeps a pod off the node.
	waitUntil(t, time.Minute, "the startup taint the node's only taint", func(ctx context.Context) (bool, string) {
		n, err := cl.Client.CoreV1().Nodes().Get(ctx, cluster.NodeName, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		return len(n.Spec.Taints) == 1 && hasStartupTaint(n), fmt.Sprint(n.Spec.Taints)
	})
	workload := pausePod(ncWorkload, "default")
	pods := cl.Client.CoreV1().Pods("default")
	waitUntil(t, time.Minute, "pod "+ncWorkload+" created", func(ctx context.Context) (bool, string) {
		_, err := pods.Create(ctx, workload, metav1.CreateOptions{})
		return err == nil, fmt.Sprint(err)
	})
	t.Cleanup(func() {
		if err := pods.Delete(context.Background(), ncWorkload, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("delete pod %s: %v", ncWorkload, err)
		}
	})
	// The scheduler names no taint (1.37: "1 node(s) had untolerated taint(s)"): the startup
	// taint is the node's only one.
	waitUntil(t, time.Minute, "the scheduler refuses "+ncWorkload+" for the startup taint", func(ctx context.Context) (bool, string) {
		p, err := pods.Get(ctx, ncWorkload, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && c.Reason == corev1.PodReasonUnschedulable && strings.Contains(c.Message, "untolerated taint") {
				return true, ""
			}
		}
		return false, fmt.Sprint(p.Status.Conditions)
	})

	tl := watchTimeline(t, ncWorkload)
	installed := time.Now()
	e.helm(t, true, e.values(false))
	pod := multiregPod(t)
	// The CSI driver's endpoint is not there: False, naming it alone once kubelet holds the
	// device plugin.
	waiting := tl.await(t, time.Minute, "the condition False naming "+ncCSI+" alone", installed, func(ev tlEvent) bool {
		return condIs(corev1.ConditionFalse, ncCSI+" (CSIPlugin): no endpoint on this node since", "1 of 2 required plugins")(ev)
	})
	c := ncCondition(waiting.node)
	t.Logf("%dms after helm install: %s %s %q", ms(waiting.at.Sub(installed)), c.Status, c.Reason, c.Message)
	if c.Reason != "RequiredPluginsMissing" || strings.Contains(c.Message, ncOptional) {
		t.Errorf("the condition: %s %q; want RequiredPluginsMissing, naming %s and not %s (not required)", c.Reason, c.Message, ncCSI, ncOptional)
	}

	// The driver starts: kubelet registers it.
	started := time.Now()
	if e.csi, err = endpoints.StartCSI(endpointPath("nc-alpha", "csi.sock"), endpoints.CSIOptions{Name: ncCSI, NodeID: ncNodeID}); err != nil {
		t.Fatal(err)
	}
	listed := tl.await(t, time.Minute, "CSINode lists "+ncCSI, started, func(ev tlEvent) bool { return listsDriver(ev, ncCSI) })
	on := tl.await(t, time.Minute, "the condition True", started, condIs(corev1.ConditionTrue))
	untainted := tl.await(t, time.Minute, "the startup taint removed", started, func(ev tlEvent) bool { return ev.node != nil && !hasStartupTaint(ev.node) })
	sched := tl.await(t, time.Minute, ncWorkload+" scheduled", started, func(ev tlEvent) bool { return ev.pod != nil && podScheduled(ev.pod) })
	if c := ncCondition(on.node); c.Reason != "RequiredPluginsRegistered" {
		t.Errorf("the condition True with reason %q %q; want RequiredPluginsRegistered", c.Reason, c.Message)
	}
	// The order, by resource versions: listed, True, untainted, scheduled.
	if !listed.before(t, on) {
		t.Errorf("the condition was True (rv %s) before CSINode listed %s (rv %s)", on.rv(), ncCSI, listed.rv())
	}
	if !on.before(t, untainted) {
		t.Errorf("the taint was removed (rv %s) before the condition was True (rv %s)", untainted.rv(), on.rv())
	}
	if !untainted.before(t, sched) {
		t.Errorf("%s was scheduled (rv %s) before the taint was removed (rv %s)", ncWorkload, sched.rv(), untainted.rv())
	}
	for _, ev := range tl.nodes(installed, on.at) {
		if c := ncCondition(ev.node); c != nil && c.Status == corev1.ConditionTrue {
			t.Errorf("the condition was True before kubelet registered %s: %+v", ncCSI, c)
		}
		if !hasStartupTaint(ev.node) {
			t.Errorf("the startup taint was gone before the condition was True: %v", ev.node.Spec.Taints)
		}
	}
	runPodWait(t, ncWorkload)
	trueAfter, untaintAfter, schedAfter := on.at.Sub(listed.at), untainted.at.Sub(on.at), sched.at.Sub(untainted.at)
	t.Logf("endpoint started → CSINode lists %s: %dms; → condition True: %dms (%dms after the listing); → taint removed: %dms after True; → %s scheduled: %dms after the removal (%dms after the endpoint started)",
		ncCSI, ms(listed.at.Sub(started)), ms(on.at.Sub(started)), ms(trueAfter), ms(untaintAfter), ncWorkload, ms(schedAfter), ms(sched.at.Sub(started)))
	figures = append(figures,
		fmt.Sprintf("node condition: True %dms after CSINode listed the last required driver (real kubelet)", ms(trueAfter)),
		fmt.Sprintf("node condition: startup taint removed %dms after the condition was True; a pod that tolerates nothing scheduled %dms after the removal", ms(untaintAfter), ms(schedAfter)))
	if trueAfter > ncBound {
		t.Errorf("True %s after CSINode listed the driver; want at most %s", trueAfter, ncBound)
	}
	log := podLog(t, pod)
	if n := strings.Count(log, "removed the startup taint"); n != 1 {
		t.Errorf("the pod logged the taint's removal %d times; want once:\n%s", n, log)
	}
	noteSockets(t, pod, ncCSI, ncDP)
	noteGaps(t, tl, "12", "installed, the CSI driver's endpoint started last", installed, time.Now())
	tl.stop()
	t.Logf("multireg wrote the condition %d times so far", e.writes(t, pod))
}

// runPodWait waits until the pod of the default namespace runs.
func runPodWait(t *testing.T, name string) {
	t.Helper()
	waitUntil(t, 2*time.Minute, "pod "+name+" runs", func(ctx context.Context) (bool, string) {
		p, err := cl.Client.CoreV1().Pods("default").Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		return p.Status.Phase == corev1.PodRunning, podState(*p)
	})
}

// 13. kubelet rejects a required CSI driver: its NodeGetInfo fails from now on, and kubelet
// restarts (a node's reboot): kubelet registers every plugin again, and rejects the CSI driver.
// The condition is False within ncBound of the rejection (kubelet's first failed NodeGetInfo,
// seen at the endpoint), naming the driver with kubelet's own words; True again once the driver
// answers and kubelet accepts it (kubelet's retry, or multireg's next socket on 1.35).
func (e *ncEnv) rejected(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	tl := watchTimeline(t, "")
	tl.await(t, 30*time.Second, "the condition True", time.Time{}, condIs(corev1.ConditionTrue))
	failedBefore := len(e.csi.NodeGetInfoFailures())
	e.csi.SetFailNodeGetInfo(1 << 20)
	if err := cl.StopKubelet(); err != nil {
		t.Fatal(err)
	}
	restart := time.Now()
	if err := cl.StartKubelet(ctx); err != nil {
		t.Fatal(err)
	}
	var rejected time.Time
	waitUntil(t, time.Minute, "kubelet's NodeGetInfo on "+ncCSI+" fails", func(context.Context) (bool, string) {
		f := e.csi.NodeGetInfoFailures()
		if len(f) > failedBefore {
			rejected = f[failedBefore]
			return true, ""
		}
		return false, "no failed call yet"
	})
	off := tl.await(t, time.Minute, "the condition False with kubelet's rejection of "+ncCSI, rejected,
		condIs(corev1.ConditionFalse, ncCSI+" (CSIPlugin): not registered", "NodeGetInfo failure injected"))
	c := ncCondition(off.node)
	took := off.at.Sub(rejected)
	t.Logf("kubelet restarted; its first NodeGetInfo on %s failed %dms after its start; the condition False %dms after that rejection: %q",
		ncCSI, ms(rejected.Sub(restart)), ms(took), c.Message)
	if took > ncBound {
		t.Errorf("False %s after kubelet's rejection; want at most %s", took, ncBound)
	}
	answered := time.Now()
	e.csi.SetFailNodeGetInfo(0)
	back := tl.await(t, time.Minute, "the condition True once kubelet accepts "+ncCSI, answered, condIs(corev1.ConditionTrue))
	t.Logf("True again %dms after the driver answered NodeGetInfo again (%d failed calls in all)", ms(back.at.Sub(answered)), len(e.csi.NodeGetInfoFailures())-failedBefore)
	figures = append(figures, fmt.Sprintf("node condition: False %dms after kubelet rejected a required CSI driver (NodeGetInfo failed); True %dms after it answered again", ms(took), ms(back.at.Sub(answered))))
	noteGaps(t, tl, "13", "kubelet restarted, rejecting the CSI driver until it answers", restart, time.Now())
	tl.stop()
	pod := multiregPod(t)
	noteSockets(t, pod, ncCSI, ncDP)
	t.Logf("multireg wrote the condition %d times so far", e.writes(t, pod))
}

// 14. The required CSI driver's registration socket removed (kubelet deregisters it, multireg
// publishes a new one), then its endpoint gone (the driver exits, its socket with it) and back:
// each makes the condition False within ncBound, naming the driver; True again after.
func (e *ncEnv) socketAndEndpoint(t *testing.T) {
	tl := watchTimeline(t, "")
	tl.await(t, 30*time.Second, "the condition True", time.Time{}, condIs(corev1.ConditionTrue))
	e.rolloutRestart(t, tl)
	removed := time.Now()
	if err := os.Remove(socketOf(t, ncCSI)); err != nil {
		t.Fatal(err)
	}
	off := tl.await(t, time.Minute, "the condition False naming "+ncCSI, removed, condIs(corev1.ConditionFalse, ncCSI+" (CSIPlugin)"))
	on := tl.await(t, time.Minute, "the condition True again", off.at, condIs(corev1.ConditionTrue))
	sockOff, sockOn := off.at.Sub(removed), on.at.Sub(off.at)
	t.Logf("registration socket removed → False %dms (%q) → True again %dms later", ms(sockOff), ncCondition(off.node).Message, ms(sockOn))
	if sockOff > ncBound {
		t.Errorf("False %s after the registration socket's removal; want at most %s", sockOff, ncBound)
	}

	noteGaps(t, tl, "14", "the CSI driver's registration socket removed", removed, time.Now())
	gone := time.Now()
	e.csi.Stop()
	off = tl.await(t, time.Minute, "the condition False: "+ncCSI+"'s endpoint gone", gone, condIs(corev1.ConditionFalse, ncCSI+" (CSIPlugin): registered, and its endpoint is gone"))
	epOff := off.at.Sub(gone)
	t.Logf("endpoint gone → False %dms: %q", ms(epOff), ncCondition(off.node).Message)
	if epOff > ncBound {
		t.Errorf("False %s after the endpoint went; want at most %s", epOff, ncBound)
	}
	restarted := time.Now()
	var err error
	if e.csi, err = endpoints.StartCSI(endpointPath("nc-alpha", "csi.sock"), endpoints.CSIOptions{Name: ncCSI, NodeID: ncNodeID}); err != nil {
		t.Fatal(err)
	}
	on = tl.await(t, time.Minute, "the condition True once the endpoint is back", restarted, condIs(corev1.ConditionTrue))
	epOn := on.at.Sub(restarted)
	t.Logf("endpoint back → True %dms", ms(epOn))
	figures = append(figures,
		fmt.Sprintf("node condition: False %dms after a required CSI driver's registration socket was removed, True %dms after that", ms(sockOff), ms(sockOn)),
		fmt.Sprintf("node condition: False %dms after a required CSI driver's endpoint went, True %dms after it came back", ms(epOff), ms(epOn)))
	noteGaps(t, tl, "14", "the CSI driver's endpoint gone and back", gone, time.Now())
	tl.stop()
	pod := multiregPod(t)
	noteSockets(t, pod, ncCSI, ncDP)
	t.Logf("multireg (pod %s) wrote the condition %d times so far", pod.Name, e.writes(t, pod))
}

// rolloutRestart rolls the DaemonSet (`kubectl rollout restart`, the chart's surge: the new pod
// takes the old one's sockets over) and checks that the hand-over happened and the node's
// condition did not move. The new process writes with a budget of its own
// (docs/node-condition.md: 10 writes at once, then one each 30 s, and each failed attempt
// spends one too): scenarios 12 and 13 spend 6 or 7 of the first process's, 14 and 15 about 4
// of the second's, 16 one and its failed attempts (6 or 7 in 30 s) of the third's. What they
// measure must not wait for the rate limit (e2e/nodecondition's
// TestFlappingDriverIsRateLimited tests it): spent, it delayed the condition's return after the
// API server's outage to 24 s in one run.
func (e *ncEnv) rolloutRestart(t *testing.T, tl *timeline) {
	t.Helper()
	// Available first: the DaemonSet controller surges only over an available pod, and
	// replaces one that is not at once, without a hand-over.
	old := waitAvailable(t)
	writes := e.writes(t, old)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	start := time.Now()
	pod, _, oldLog, err := restartRelease(t, ctx, old)
	if err != nil {
		t.Fatal(err)
	}
	newLog := podLog(t, pod)
	t.Logf("the old pod's log:\n%s\nthe new pod's log:\n%s", strings.Join(linesWith(oldLog, "hand", msgStopped, "node condition"), "\n"),
		strings.Join(linesWith(newLog, "hand-over", "took over", "standing by", "serving the registration directory", "node condition"), "\n"))
	if !strings.Contains(newLog, msgTookOver) || !strings.Contains(oldLog, msgHanded) {
		t.Errorf("no hand-over: the new pod's log does not say %q, or the old pod's %q", msgTookOver, msgHanded)
	}
	for _, ev := range tl.nodes(start, time.Now()) {
		if c := ncCondition(ev.node); c == nil || c.Status != corev1.ConditionTrue {
			t.Errorf("the condition moved during the rollout: %+v", c)
		}
	}
	t.Logf("rollout restart: pod %s (%d writes of the condition) → %s, %dms; the condition stayed True", old.Name, writes, pod.Name, ms(time.Since(start)))
	noteSockets(t, pod, ncCSI, ncDP)
	// Handed over, kubelet keeps every registration: nothing leaves CSINode or allocatable.
	if csi, alloc := noteGaps(t, tl, strings.SplitN(t.Name(), "/", 2)[1][:2], "rollout restart with hand-over", start, time.Now()); csi.times > 0 || alloc.times > 0 {
		t.Errorf("during the rollout with hand-over %s left CSINode %s, and %s allocatable was short %s; want never", ncCSI, csi, ncDP, alloc)
	}
}

// restartRelease rolls the release's DaemonSet once (kubectl rollout restart, then rollout
// status) and waits for the pod that replaces old to be Ready and for old's container to end.
// It returns that pod, when it was seen Ready, and old's log, followed until its container
// ended; an error when kubectl fails.
func restartRelease(t *testing.T, ctx context.Context, old corev1.Pod) (pod corev1.Pod, ready time.Time, oldLog string, err error) {
	t.Helper()
	logDone := make(chan struct{})
	go func() {
		defer close(logDone)
		oldLog, _ = cl.Kubectl(ctx, "logs", "-f", "-n", ncNS, old.Name)
	}()
	for _, args := range [][]string{
		{"rollout", "restart", "-n", ncNS, "ds/" + ncRelease},
		{"rollout", "status", "-n", ncNS, "ds/" + ncRelease, "--timeout=2m"},
	} {
		if out, err := cl.Kubectl(ctx, args...); err != nil {
			// The log's kubectl ends with ctx, or with old's container.
			return corev1.Pod{}, time.Time{}, "", fmt.Errorf("kubectl %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	pod = waitPodReady(t, 2*time.Minute, string(old.UID))
	ready = time.Now()
	waitUntil(t, 30*time.Second, "the old pod's log ends with its container", func(context.Context) (bool, string) {
		select {
		case <-logDone:
			return true, ""
		default:
			return false, "kubectl logs -f still follows " + old.Name
		}
	})
	return pod, ready, oldLog, nil
}

// waitAvailable waits for the release's one pod Ready as the running kubelet probed it, and
// available as the DaemonSet controller counts it, and returns it. Ready on the API server is
// not enough after a kubelet restart: the Pod keeps the last kubelet's Ready until the new one
// has synced it, and kubelet 1.35.4 then reports the container not Ready until its first
// readiness probe (every 5 s) — in one run, a rollout begun 2.9 s after scenario 13's kubelet
// restart met a pod the controller then counted unavailable, and it replaced it without a
// surge, so without a hand-over.
func waitAvailable(t *testing.T) corev1.Pod {
	t.Helper()
	pod := waitPodReady(t, time.Minute, "")
	waitUntil(t, time.Minute, "a readiness probe of "+pod.Name+" by the running kubelet succeeded", func(ctx context.Context) (bool, string) {
		pc, err := kubeletProbes(ctx, string(pod.UID), "multireg", "Readiness")
		if err != nil {
			return false, err.Error()
		}
		return pc.Successful > 0, fmt.Sprintf("kubelet's readiness probes of it: %+v", pc)
	})
	pod = waitPodReady(t, time.Minute, "")
	waitDSAvailable(t, pod)
	return pod
}

// waitDSAvailable waits until the release's DaemonSet controller has seen its current
// generation and counts pod Ready and available (its status: one pod, available, updated), and
// logs since when the pod is Ready.
func waitDSAvailable(t *testing.T, pod corev1.Pod) {
	t.Helper()
	waitUntil(t, time.Minute, "the DaemonSet controller counts "+pod.Name+" available", func(ctx context.Context) (bool, string) {
		ds, err := cl.Client.AppsV1().DaemonSets(ncNS).Get(ctx, ncRelease, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		st := ds.Status
		return st.ObservedGeneration == ds.Generation && st.DesiredNumberScheduled == 1 && st.NumberReady == 1 && st.NumberAvailable == 1 && st.NumberUnavailable == 0 && st.UpdatedNumberScheduled == 1,
			fmt.Sprintf("generation %d, status %+v", ds.Generation, st)
	})
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReady {
			t.Logf("pod %s Ready since %s (%dms ago); the DaemonSet controller counts it available", pod.Name, c.LastTransitionTime.UTC().Format(time.RFC3339), ms(time.Since(c.LastTransitionTime.Time)))
		}
	}
}

// writes is how many times the pod's multireg wrote the condition, from its /status.
func (e *ncEnv) writes(t *testing.T, pod corev1.Pod) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	nc, err := nodeConditionAt(ctx, pod)
	if err != nil {
		t.Fatal(err)
	}
	return nc.Writes
}

// podToken reads the pod's service-account token as kubelet projected it into the pod (its
// kube-api-access volume below kubelet's root): bound to the pod and its node.
func podToken(t *testing.T, pod corev1.Pod) string {
	t.Helper()
	matches, err := filepath.Glob(filepath.Join(cl.KubeletRoot, "pods", string(pod.UID), "volumes", "kubernetes.io~projected", "kube-api-access-*", "token"))
	if err != nil || len(matches) != 1 {
		t.Fatalf("the pod %s's projected token: %v %v", pod.Name, matches, err)
	}
	b, err := os.ReadFile(matches[0])
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

// 15. The admission policy: the multireg pod's own token (projected by kubelet, bound to the
// pod and its node), which RBAC lets patch every node's status, may write the condition on its
// own node and is refused on another Node, with the policy's message.
func (e *ncEnv) admissionPolicy(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	nodes := cl.Client.CoreV1().Nodes()
	if _, err := nodes.Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: ncOther}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := nodes.Delete(context.Background(), ncOther, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("delete node %s: %v", ncOther, err)
		}
	})
	pod := multiregPod(t)
	cfg, err := clientcmd.BuildConfigFromFlags("", cl.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	cfg.BearerToken, cfg.BearerTokenFile = podToken(t, pod), ""
	as, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	review, err := as.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	user := review.Status.UserInfo
	t.Logf("the pod's token: user %s, extra %v", user.Username, user.Extra)
	if want := "system:serviceaccount:" + ncNS + ":" + ncRelease; user.Username != want || fmt.Sprint(user.Extra["authentication.kubernetes.io/node-name"]) != "["+cluster.NodeName+"]" {
		t.Errorf("the pod's token authenticates as %s with node-name %v; want %s bound to node %s", user.Username, user.Extra["authentication.kubernetes.io/node-name"], want, cluster.NodeName)
	}
	// RBAC lets the account patch any node's status: a refusal is the policy's.
	access, err := as.AuthorizationV1().SelfSubjectAccessReviews().Create(ctx, &authorizationv1.SelfSubjectAccessReview{Spec: authorizationv1.SelfSubjectAccessReviewSpec{
		ResourceAttributes: &authorizationv1.ResourceAttributes{Verb: "patch", Resource: "nodes", Subresource: "status", Name: ncOther},
	}}, metav1.CreateOptions{})
	if err != nil || !access.Status.Allowed {
		t.Fatalf("RBAC: may the pod's token patch %s's status? %+v %v; want allowed (the ClusterRole's patch of nodes/status)", ncOther, access.Status, err)
	}
	patch := func(node string, c corev1.NodeCondition) error {
		// A heartbeat later than the one there (to the second, as the API keeps it): a
		// patch that changes nothing would be admitted without a write.
		hb := time.Now().Truncate(time.Second)
		if !hb.After(c.LastHeartbeatTime.Time) {
			hb = c.LastHeartbeatTime.Add(time.Second)
		}
		c.LastHeartbeatTime = metav1.NewTime(hb)
		b, err := json.Marshal(map[string]any{"status": map[string]any{"conditions": []corev1.NodeCondition{c}}})
		if err != nil {
			t.Fatal(err)
		}
		_, err = as.CoreV1().Nodes().Patch(ctx, node, types.StrategicMergePatchType, b, metav1.PatchOptions{FieldManager: "e2e-forger"}, "status")
		return err
	}
	forged := corev1.NodeCondition{Type: ncType, Status: corev1.ConditionTrue, Reason: "RequiredPluginsRegistered", Message: "forged by another node's token", LastTransitionTime: metav1.Now()}
	err = patch(ncOther, forged)
	refusals := []string{fmt.Sprintf("another node's status: %v", err)}
	wantMsg := fmt.Sprintf("multireg's service account changes only the node its pod runs on, %s, not %s", cluster.NodeName, ncOther)
	t.Logf("the pod's token patching %s's status: %v", ncOther, err)
	if !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), "ValidatingAdmissionPolicy") || !strings.Contains(err.Error(), wantMsg) {
		t.Errorf("patch of %s's status with the pod's token: %v; want Forbidden by the ValidatingAdmissionPolicy: %q", ncOther, err, wantMsg)
	}
	if other, err := nodes.Get(ctx, ncOther, metav1.GetOptions{}); err != nil || ncCondition(other) != nil {
		t.Errorf("%s after the refused patch: %v %v; want no multireg condition", ncOther, other.Status.Conditions, err)
	}
	// Its own node: the condition as it is, a new heartbeat.
	own, err := nodes.Get(ctx, cluster.NodeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	c := ncCondition(own)
	if c == nil {
		t.Fatal("no multireg condition on the node")
	}
	if err := patch(cluster.NodeName, *c); err != nil {
		t.Errorf("patch of its own node's condition with the pod's token: %v; want allowed", err)
	}
	after, err := nodes.Get(ctx, cluster.NodeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	wrote := false
	for _, f := range after.ManagedFields {
		wrote = wrote || f.Manager == "e2e-forger" && f.Subresource == "status"
	}
	if a := ncCondition(after); a == nil || a.Status != c.Status || a.Message != c.Message || !wrote {
		t.Errorf("the node's condition after the allowed patch: %+v (written by the pod's token: %v); before: %+v", a, wrote, c)
	}

	// Its own node, anything but its condition and the startup taint's removal: refused.
	forgedReady := corev1.NodeCondition{Type: corev1.NodeReady, Status: corev1.ConditionFalse, Reason: "Forged", Message: "forged by multireg's token", LastHeartbeatTime: metav1.Now(), LastTransitionTime: metav1.Now()}
	readyPatch, err := json.Marshal(map[string]any{"status": map[string]any{"conditions": []corev1.NodeCondition{forgedReady}}})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range []struct {
		what, sub, body, want string
		undo                  string // a patch undoing it, were it admitted
	}{
		{"another condition (Ready) of its own node", "status", string(readyPatch),
			"multireg's service account changes nothing of a node's status but its own condition, " + ncType, ""},
		{"a label of its own node", "", `{"metadata":{"labels":{"e2e-forged":"yes"}}}`,
			"multireg's service account changes no label, annotation, owner or finalizer of a node", `{"metadata":{"labels":{"e2e-forged":null}}}`},
		{"a taint added to its own node", "", `{"spec":{"taints":[{"key":"e2e-forged","effect":"NoSchedule"}]}}`,
			"multireg's service account changes nothing of a node's spec but the removal of its startup taint, " + ncTaint, `{"spec":{"taints":null}}`},
	} {
		var subs []string
		if r.sub != "" {
			subs = append(subs, r.sub)
		}
		_, err := as.CoreV1().Nodes().Patch(ctx, cluster.NodeName, types.StrategicMergePatchType, []byte(r.body), metav1.PatchOptions{FieldManager: "e2e-forger"}, subs...)
		t.Logf("the pod's token changing %s: %v", r.what, err)
		if !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), "ValidatingAdmissionPolicy") || !strings.Contains(err.Error(), r.want) {
			t.Errorf("the pod's token changing %s: %v; want Forbidden by the ValidatingAdmissionPolicy: %q", r.what, err, r.want)
			if err == nil && r.undo != "" {
				if _, err := nodes.Patch(ctx, cluster.NodeName, types.StrategicMergePatchType, []byte(r.undo), metav1.PatchOptions{}); err != nil {
					t.Errorf("undo %s: %v", r.what, err)
				}
			}
		}
		refusals = append(refusals, fmt.Sprintf("%s: %v", r.what, err))
	}
	if n, err := nodes.Get(ctx, cluster.NodeName, metav1.GetOptions{}); err != nil {
		t.Error(err)
	} else {
		for _, c := range n.Status.Conditions {
			if c.Message == forgedReady.Message {
				t.Errorf("the node's %s condition after the refused patch: %+v", c.Type, c)
			}
		}
		forgedTaint := false
		for _, tn := range n.Spec.Taints {
			forgedTaint = forgedTaint || tn.Key == "e2e-forged"
		}
		if _, ok := n.Labels["e2e-forged"]; ok || forgedTaint {
			t.Errorf("the node after the refused patches: labels %v, taints %v", n.Labels, n.Spec.Taints)
		}
	}

	// A token of the same service account bound to no pod (a TokenRequest's, as someone who
	// may create tokens for it makes): RBAC lets it patch every node's status; the policy
	// refuses it even its own condition on this node.
	tr, err := cl.Client.CoreV1().ServiceAccounts(ncNS).CreateToken(ctx, ncRelease, &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: ptrTo(int64(600))}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cfg2 := *cfg
	cfg2.BearerToken = tr.Status.Token
	unbound, err := kubernetes.NewForConfig(&cfg2)
	if err != nil {
		t.Fatal(err)
	}
	own, err = nodes.Get(ctx, cluster.NodeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	b, err := json.Marshal(map[string]any{"status": map[string]any{"conditions": []corev1.NodeCondition{*ncCondition(own)}}})
	if err != nil {
		t.Fatal(err)
	}
	_, err = unbound.CoreV1().Nodes().Patch(ctx, cluster.NodeName, types.StrategicMergePatchType, b, metav1.PatchOptions{FieldManager: "e2e-forger"}, "status")
	t.Logf("a token of %s bound to no pod, writing the condition on %s: %v", ncRelease, cluster.NodeName, err)
	const wantUnbound = "this request's token names no node"
	if !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), "ValidatingAdmissionPolicy") || !strings.Contains(err.Error(), wantUnbound) {
		t.Errorf("a token bound to no pod writing the condition: %v; want Forbidden by the ValidatingAdmissionPolicy: %q", err, wantUnbound)
	}
	refusals = append(refusals, fmt.Sprintf("a token bound to no pod, its own condition: %v", err))
	for _, r := range refusals {
		figures = append(figures, "node condition: refused with the pod's service account: "+r)
	}
	figures = append(figures, "node condition: the pod's token allowed to write its condition on its own node")
}

func ptrTo[T any](v T) *T { return &v }

// podNodeCondition is the nodeCondition of multireg's /status.
type podNodeCondition struct {
	Status      string `json:"status"`
	Synced      bool   `json:"synced"`
	Writes      int    `json:"writes"`
	WriteErrors int    `json:"writeErrors"`
	LastError   string `json:"lastError"`
}

func nodeConditionAt(ctx context.Context, pod corev1.Pod) (podNodeCondition, error) {
	var doc struct {
		NodeCondition podNodeCondition `json:"nodeCondition"`
	}
	if err := getJSON(ctx, podStatusURL(pod), &doc); err != nil {
		return podNodeCondition{}, err
	}
	return doc.NodeCondition, nil
}

// 16. The API server stopped for 30 s. A required DRA driver is added first (the condition
// False: no endpoint), and starts once the API server is down: kubelet registers it all the
// same (its verdict, and kubelet's DRA manager connects to it), and nothing else moves. The API
// server starts again: the condition, read every 100 ms, is True within seconds (measured from
// the API server's readiness), with no other value in between.
func (e *ncEnv) apiServerStopped(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	// A process with its whole write budget, as on a node whose drivers have been quiet: each
	// failed write spends one of it too (rolloutRestart says why that matters).
	tl := watchTimeline(t, "")
	e.rolloutRestart(t, tl)
	tl.stop()
	pod := multiregPod(t)
	e.withDRA = true
	edited := time.Now()
	e.helm(t, false, e.values(false))
	var c *corev1.NodeCondition
	waitUntil(t, time.Minute, "the condition False naming "+ncDRA, func(ctx context.Context) (bool, string) {
		n, err := cl.Client.CoreV1().Nodes().Get(ctx, cluster.NodeName, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		c = ncCondition(n)
		return c != nil && c.Status == corev1.ConditionFalse && strings.Contains(c.Message, ncDRA+" (DRAPlugin): no endpoint on this node"), fmt.Sprintf("%+v", c)
	})
	t.Logf("helm upgrade adding %s (required) → the condition False %dms later: %q", ncDRA, ms(time.Since(edited)), c.Message)
	before := waitRegisteredAt(t, "multireg in pod "+pod.Name, podStatusURL(pod), ncCSI, ncDP)
	ncBefore, err := nodeConditionAt(ctx, pod)
	if err != nil {
		t.Fatal(err)
	}

	stopped := time.Now()
	if err := cl.StopAPIServer(); err != nil {
		t.Fatal(err)
	}
	up := false
	t.Cleanup(func() {
		if !up {
			if err := cl.StartAPIServer(context.Background()); err != nil {
				t.Errorf("start the API server again: %v", err)
			}
		}
	})
	if e.dra, err = endpoints.StartDRA(endpointPath("nc-dra", "dra.sock"), endpoints.DRAOptions{DriverName: ncDRA}); err != nil {
		t.Fatal(err)
	}
	draStarted := time.Now()
	var reg map[string]driverStatus
	waitUntil(t, 20*time.Second, "kubelet registers "+ncDRA+" while the API server is down", func(ctx context.Context) (bool, string) {
		st, err := statusAt(ctx, podStatusURL(pod))
		if err != nil {
			return false, err.Error()
		}
		reg = st
		return st[ncDRA].Phase == "Registered" && e.dra.Connections() > 0, fmt.Sprintf("%+v; kubelet's DRA connections: %d", st[ncDRA], e.dra.Connections())
	})
	registered := time.Now()
	sockets[ncDRA] = reg[ncDRA].Socket
	t.Logf("%s registered by kubelet %dms after its endpoint started, %dms into the outage", ncDRA, ms(registered.Sub(draStarted)), ms(registered.Sub(stopped)))
	var nc podNodeCondition
	waitUntil(t, 10*time.Second, "multireg decides True, and cannot write it", func(ctx context.Context) (bool, string) {
		var err error
		if nc, err = nodeConditionAt(ctx, pod); err != nil {
			return false, err.Error()
		}
		return nc.Status == "True" && !nc.Synced, fmt.Sprintf("%+v", nc)
	})
	t.Logf("multireg's view during the outage: %+v", nc)
	// Nothing else moves until the outage has lasted 30 s.
	stays(t, time.Until(stopped.Add(30*time.Second)), "registration unaffected while the API server is down", func(ctx context.Context) (string, error) {
		st, err := statusAt(ctx, podStatusURL(pod))
		if err != nil {
			return "", err
		}
		for _, n := range []string{ncCSI, ncDP} {
			if st[n].Phase != "Registered" || st[n].Attempts != before[n].Attempts {
				return fmt.Sprintf("%s: %+v, before the outage %+v", n, st[n], before[n]), nil
			}
		}
		if st[ncDRA].Phase != "Registered" || st[ncDRA].Attempts != reg[ncDRA].Attempts {
			return fmt.Sprintf("%s: %+v, when registered %+v", ncDRA, st[ncDRA], reg[ncDRA]), nil
		}
		return "", nil
	})
	if err := cl.StartAPIServer(ctx); err != nil {
		t.Fatal(err)
	}
	up = true
	ready := time.Now()
	// Every 100 ms from the API server's readiness: each distinct value of the condition.
	var seen []string
	var on time.Time
	waitUntil(t, 30*time.Second, "the condition True after the API server's return", func(ctx context.Context) (bool, string) {
		n, err := cl.Client.CoreV1().Nodes().Get(ctx, cluster.NodeName, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		c := ncCondition(n)
		if c == nil {
			return false, "no multireg condition on the node"
		}
		s := fmt.Sprintf("%s %s %q", c.Status, c.Reason, c.Message)
		if len(seen) == 0 || seen[len(seen)-1] != s {
			seen = append(seen, s)
		}
		if c.Status == corev1.ConditionTrue {
			on = time.Now()
			return true, ""
		}
		return false, s
	})
	catchUp := on.Sub(ready)
	ncAfter, err := nodeConditionAt(ctx, pod)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("the API server down %dms (killed, then ready again); the condition True %dms after it was ready; values seen: %v; multireg's writes before the outage %d, failed attempts during it %d, writes after %d",
		ms(ready.Sub(stopped)), ms(catchUp), seen, ncBefore.Writes, ncAfter.WriteErrors-ncBefore.WriteErrors, ncAfter.Writes-ncBefore.Writes)
	figures = append(figures,
		fmt.Sprintf("API server down %dms: a required DRA driver started in the outage registered by kubelet %dms after it started (%dms into the outage)", ms(ready.Sub(stopped)), ms(registered.Sub(draStarted)), ms(registered.Sub(stopped))),
		fmt.Sprintf("node condition: True %dms after the API server was ready again", ms(catchUp)))
	if len(seen) > 2 || !strings.HasPrefix(seen[len(seen)-1], "True RequiredPluginsRegistered") {
		t.Errorf("the condition after the API server's return: %v; want the value before the outage, then True", seen)
	}
	// multireg's retries of its watches and writes back off to 8 s (±20 %): a catch-up beyond
	// that, a write's settle and a round trip is wrong.
	if catchUp > 12*time.Second {
		t.Errorf("the condition True %s after the API server was ready; want within seconds (multireg's retries back off to 8 s ±20%%)", catchUp)
	}
	// Synced, and its watches read the API server again (its log says so).
	waitUntil(t, 30*time.Second, "multireg synced, its watches reading again", func(ctx context.Context) (bool, string) {
		var err error
		if nc, err = nodeConditionAt(ctx, pod); err != nil {
			return false, err.Error()
		}
		answers := strings.Contains(podLog(t, pod), "the API server answers again")
		return nc.Synced && answers, fmt.Sprintf("%+v; logged that the API server answers again: %v", nc, answers)
	})
	if nc.LastError != "" {
		// nodecond's Status says "" once a read or a write succeeds; the loop clears it only
		// when a write succeeds, and a watch's error noted after that write stays.
		t.Logf("NOTE: multireg's /status still says lastError %q, although it wrote the condition and its watches read the API server again", nc.LastError)
	}
	waitKubeletHolds(t, ncCSI, ncDP, ncDRA)
	t.Logf("multireg (pod %s) wrote the condition %d times", pod.Name, e.writes(t, pod))

	// The cluster's own components notice the API server's return up to a minute later
	// (client-go's reflectors back off up to 30 s, jittered): in one run the DaemonSet
	// controller created the next scenario's surge pod 45 s after its helm upgrade, and
	// kubelet started the pod's container 11 s after that; with the controllers restarted,
	// kubelet alone started it 23 s after. Restarted, they list at once. Nothing here
	// measures them.
	restarted := time.Now()
	if err := cl.RestartControllers(ctx); err != nil {
		t.Fatal(err)
	}
	if err := cl.StopKubelet(); err != nil {
		t.Fatal(err)
	}
	if err := cl.StartKubelet(ctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("kube-controller-manager, kube-scheduler and kubelet restarted: %dms", ms(time.Since(restarted)))
}

// uninstall removes the release when it is installed: with check (17), as docs/deploy.md says
// (cleanupOnExit, the rollout, the DaemonSet, then the uninstall), and checks that the registration sockets
// went and reports what the node's condition says after; without (the test's cleanup, after a
// failure), with helm uninstall alone.
func (e *ncEnv) uninstall(t *testing.T, check bool) {
	if !e.installed {
		return
	}
	e.installed = false
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	if t.Failed() {
		if pods, err := multiregPods(ctx); err == nil {
			for _, p := range pods {
				out, _ := cl.Kubectl(ctx, "logs", "-n", ncNS, p.Name, "--tail=80")
				t.Logf("the last lines of pod %s's log:\n%s", p.Name, out)
			}
		}
	}
	var socks []string
	var logDone chan struct{} // closed when the log of the pod that withdraws every socket ends
	if check {
		for _, n := range []string{ncCSI, ncDP, ncDRA} {
			if s, ok := sockets[n]; ok {
				socks = append(socks, s)
			}
		}
	}
	if check {
		// docs/deploy.md's uninstall: the sockets go with the pod.
		old := waitAvailable(t)
		upgraded := time.Now()
		e.helm(t, false, e.values(true))
		if out, err := cl.Kubectl(ctx, "rollout", "status", "-n", ncNS, "ds/"+ncRelease, "--timeout=2m"); err != nil {
			t.Errorf("rollout with cleanupOnExit: %v\n%s", err, out)
		}
		pod := waitPodReady(t, time.Minute, string(old.UID))
		t.Logf("rollout with cleanupOnExit: %dms", ms(time.Since(upgraded)))
		// Its log, until its container ends: what it did on its way out.
		logDone = make(chan struct{})
		defer func() { cancel(); <-logDone }()
		go func() {
			defer close(logDone)
			out, err := cl.Kubectl(ctx, "logs", "-f", "-n", ncNS, pod.Name)
			t.Logf("pod %s's log from its SIGTERM on (%v):\n%s", pod.Name, err, strings.Join(linesWith(out, "signal", "withdr", "node condition", "Unknown", msgStopped), "\n"))
		}()
	}
	start := time.Now()
	if check {
		// docs/deploy.md: the DaemonSet first, alone, so that its pods' last write (the
		// condition Unknown) is made while the release's permissions are still there.
		fg := metav1.DeletePropagationForeground
		if err := cl.Client.AppsV1().DaemonSets(ncNS).Delete(ctx, ncRelease, metav1.DeleteOptions{PropagationPolicy: &fg}); err != nil {
			t.Errorf("kubectl delete ds: %v", err)
		}
		waitNoPods(t)
		t.Logf("kubectl delete ds --cascade=foreground --wait: %dms", ms(time.Since(start)))
	}
	un := action.NewUninstall(helmConfig(t))
	un.Wait, un.DeletionPropagation, un.Timeout = true, "foreground", 2*time.Minute
	if _, err := un.Run(ncRelease); err != nil {
		t.Errorf("helm uninstall: %v", err)
		return
	}
	t.Logf("helm uninstall --wait: %dms", ms(time.Since(start)))
	waitNoPods(t)
	if !check {
		return
	}
	waitUntil(t, 30*time.Second, "the pod's log ends with its container", func(context.Context) (bool, string) {
		select {
		case <-logDone:
			return true, ""
		default:
			return false, "kubectl logs -f still follows it"
		}
	})
	for _, s := range socks {
		if _, err := os.Lstat(s); !os.IsNotExist(err) {
			t.Errorf("registration socket %s left after the uninstall (%v)", s, err)
		}
	}
	n, err := cl.Client.CoreV1().Nodes().Get(ctx, cluster.NodeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	c := ncCondition(n)
	t.Logf("the node's condition after the uninstall: %+v", c)
	if c == nil || c.Status != corev1.ConditionUnknown || c.Reason != "MultiregStopped" {
		// docs/node-condition.md says Unknown (MultiregStopped), written by the pod on its
		// way out with the permissions the rest of the release still grants.
		t.Errorf("every registration socket is gone, and the node's condition says %+v, want Unknown MultiregStopped", c)
		return
	}
	figures = append(figures, fmt.Sprintf("node condition after the uninstall (cleanupOnExit, the DaemonSet, then helm uninstall): %s %s", c.Status, c.Reason))
}

// getJSON decodes the JSON document at url into v.
func getJSON(ctx context.Context, url string, v any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", url, resp.Status)
	}
	return json.NewDecoder(resp.Body).Decode(v)
}
