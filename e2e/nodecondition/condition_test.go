package nodecondition

import (
	"context"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"multireg.dev/multireg/e2e/internal/child"
	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/kubelet"
	"multireg.dev/multireg/e2e/mrproc"
)

// bound is the most a change of kubelet's view may take to show in the condition: kubelet's
// reconcile pass (1 s) and an API round trip, with room for a loaded 2-core machine. The
// figures logged are what the tests measured.
const bound = 1500 * time.Millisecond

// TestConditionFollowsKubelet: the condition goes True once kubelet holds every required
// driver (its verdict, and for the CSI driver the node's CSINode; a driver that is not
// required and not even on the node does not count), and False, naming the driver and why,
// when the CSI driver's registration socket is removed and when the DRA driver's endpoint
// goes; True again once kubelet holds them again. Each change shows within bound of what
// caused it.
func TestConditionFollowsKubelet(t *testing.T) {
	t.Parallel()
	n := newNode(t)
	csi, dra, dev := required("nfs.csi.k8s.io", "CSIPlugin"), required("gpu.example.com", "DRAPlugin"), required("example.com/gpu", "DevicePlugin")
	opt := driver{Name: "optional.example.com", Type: "DRAPlugin"} // not required; never started
	ds := []driver{csi, dra, dev}
	n.StartEndpoints(ds)
	start := time.Now()
	p := n.start(append(ds, opt))
	first := n.await("the condition True", start, isTrue)
	if first.Cond.Reason != "RequiredPluginsRegistered" || first.Cond.LastTransitionTime.IsZero() {
		t.Errorf("condition %+v, want reason RequiredPluginsRegistered and a transition time", first.Cond)
	}
	last := lastRegistration(n.K, ds)
	t.Logf("True %s after kubelet registered the last required driver (%s after multireg started)",
		first.At.Sub(last).Round(time.Millisecond), first.At.Sub(start).Round(time.Millisecond))
	if d := first.At.Sub(last); d > bound {
		t.Errorf("True %s after the last registration, want at most %s", d, bound)
	}

	// The CSI driver's registration socket removed: kubelet deregisters it.
	removed := time.Now()
	if err := os.Remove(n.SocketPath(csi)); err != nil {
		t.Fatal(err)
	}
	off := n.await("the condition False for the CSI driver", removed, isFalse(csi.Name))
	t.Logf("False %s after the CSI driver's registration socket was removed: %q", off.At.Sub(removed).Round(time.Millisecond), off.Cond.Message)
	if d := off.At.Sub(removed); d > bound {
		t.Errorf("False %s after the socket's removal, want at most %s", d, bound)
	}
	back := n.await("the condition True again", off.At, isTrue)
	t.Logf("True again %s after", back.At.Sub(off.At).Round(time.Millisecond))

	// The DRA driver's endpoint gone (the driver exits and removes its socket).
	gone := time.Now()
	n.StopEndpoint(dra)
	off = n.await("the condition False for the DRA driver", gone, isFalse(dra.Name, "endpoint is gone"))
	t.Logf("False %s after the DRA driver's endpoint went: %q", off.At.Sub(gone).Round(time.Millisecond), off.Cond.Message)
	if d := off.At.Sub(gone); d > bound {
		t.Errorf("False %s after the endpoint went, want at most %s", d, bound)
	}
	if strings.Contains(off.Cond.Message, opt.Name) {
		t.Errorf("the message names %s, which is not required: %q", opt.Name, off.Cond.Message)
	}
	restarted := time.Now()
	n.StartEndpoint(dra)
	back = n.await("the condition True once the DRA driver is back", restarted, isTrue)
	t.Logf("True again %s after the DRA driver came back", back.At.Sub(restarted).Round(time.Millisecond))
	stop(t, p)
}

// TestConditionNamesKubeletsRejection: a required CSI driver that kubelet rejects makes the
// condition False with kubelet's own words, within bound of the rejection; not one that is
// not required.
func TestConditionNamesKubeletsRejection(t *testing.T) {
	t.Parallel()
	n := newNode(t)
	csi, dra := required("rejected.csi.example.com", "CSIPlugin"), required("gpu.example.com", "DRAPlugin")
	ds := []driver{csi, dra}
	n.StartEndpoints(ds)
	n.K.FailRegistrations(csi.Name, 1000)
	start := time.Now()
	p := n.start(ds)
	off := n.await("the condition False with kubelet's rejection", start, isFalse(csi.Name, "injected registration failure"))
	rejected := firstEvent(n.K, csi.Name, kubelet.EventRegisterFailed)
	t.Logf("False %s after kubelet's first rejection: %q", off.At.Sub(rejected).Round(time.Millisecond), off.Cond.Message)
	if d := off.At.Sub(rejected); d > bound {
		t.Errorf("False %s after the rejection, want at most %s", d, bound)
	}
	n.K.FailRegistrations(csi.Name, 0)
	n.await("the condition True once kubelet accepts the driver", off.At, isTrue)
	stop(t, p)
}

// TestCSIDriverMissingFromCSINode: a CSI driver kubelet accepts that the node's CSINode does
// not list is not held (the condition says so), and after two reconcile passes it is a
// warning: the log, /status and the metric say so.
func TestCSIDriverMissingFromCSINode(t *testing.T) {
	t.Parallel()
	n := newNode(t)
	csi := required("unlisted.csi.example.com", "CSIPlugin")
	n.unlist(csi.Name)
	n.StartEndpoints([]driver{csi})
	start := time.Now()
	p := n.start([]driver{csi})
	n.await("the condition False: not in CSINode", start, isFalse(csi.Name, "not listed in the node's CSINode"))
	wait.For(t, registerTimeout, "the warning", func() bool {
		return p.Count("kubelet accepted the CSI driver, and the node's CSINode does not list it", csi.Name) == 1
	})
	if v := mrproc.Metric(p.Metrics(t), `multireg_csinode_missing{driver="unlisted.csi.example.com"}`); v != 1 {
		t.Errorf("multireg_csinode_missing is %v, want 1", v)
	}
	stop(t, p)
}

// TestNoWritesWhileNothingChanges: once the node shows the condition, multireg writes nothing
// more while nothing changes (no heartbeat), whatever else changes on the Node.
func TestNoWritesWhileNothingChanges(t *testing.T) {
	t.Parallel()
	n := newNode(t)
	ds := []driver{required("quiet.csi.example.com", "CSIPlugin"), required("quiet.example.com", "DRAPlugin")}
	p, _ := n.running(ds)
	before := writes(t, p)
	settled := time.Now()
	n.setTaints([]corev1.Taint{{Key: "example.com/other", Effect: corev1.TaintEffectNoSchedule}}) // another writer's change
	wait.Never(t, 10*time.Second, "a write of the condition", func() bool { return n.changesSince(settled) > 0 })
	if w := writes(t, p); w != before {
		t.Errorf("%v writes in 10 s of nothing changing, want none", w-before)
	}
	stop(t, p)
}

// TestFlappingDriverIsRateLimited: a required driver whose endpoint comes and goes every
// second for a minute costs at most 10 writes at once and one more each 30 s: the worst a
// node writes. The figure is logged.
func TestFlappingDriverIsRateLimited(t *testing.T) {
	t.Parallel()
	n := newNode(t)
	d := required("flapping.example.com", "DRAPlugin")
	p, _ := n.running([]driver{d})
	before := writes(t, p)
	flapping := time.Now()
	const window = time.Minute
	flap := time.NewTicker(time.Second)
	defer flap.Stop()
	for up := false; time.Since(flapping) < window; up = !up {
		if up {
			n.StartEndpoint(d)
		} else {
			n.StopEndpoint(d)
		}
		<-flap.C
	}
	wrote := writes(t, p) - before
	t.Logf("%v writes in %s of a required driver's endpoint coming and going each second (%v changes of the node's condition seen)",
		wrote, window, n.changesSince(flapping))
	if most := 10 + window/(30*time.Second) + 1; wrote > float64(most) {
		t.Errorf("%v writes, want at most %d", wrote, most)
	}
	stop(t, p)
}

// TestStartupTaint: the startup taint is removed once, the first time the condition is True,
// and never again: put back, it stays.
func TestStartupTaint(t *testing.T) {
	t.Parallel()
	taint := corev1.Taint{Key: "multireg.dev/plugins-not-ready", Effect: corev1.TaintEffectNoSchedule}
	other := corev1.Taint{Key: "example.com/other", Value: "x", Effect: corev1.TaintEffectNoExecute}
	n := newNode(t, taint, other)
	d := required("tainted.example.com", "DRAPlugin")
	p, on := n.running([]driver{d}, "--startup-taint", "multireg.dev/plugins-not-ready:NoSchedule")
	var removed time.Time
	var ts []corev1.Taint
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("the node's taints: %+v", ts)
		}
	})
	// The others stay: ours, and the API server's (node.kubernetes.io/not-ready, which its
	// TaintNodesByCondition admission puts on a new Node).
	wait.For(t, registerTimeout, "the startup taint removed", func() bool {
		ts = n.taints()
		if !hasTaint(ts, taint) && hasTaint(ts, other) {
			removed = time.Now()
			return true
		}
		return false
	})
	t.Logf("the startup taint was gone %s after the condition was True", removed.Sub(on.At).Round(time.Millisecond))
	n.setTaints(append(ts, taint))
	wait.Never(t, 5*time.Second, "the startup taint removed again", func() bool { return !hasTaint(n.taints(), taint) })
	stop(t, p)
}

// TestHandoverKeepsTheCondition: a rolling update's new multireg takes the directory over and
// keeps the condition as the old one wrote it: no write, no transition.
func TestHandoverKeepsTheCondition(t *testing.T) {
	t.Parallel()
	n := newNode(t)
	ds := []driver{required("handed.csi.example.com", "CSIPlugin"), required("handed.example.com", "DRAPlugin")}
	first, on := n.running(ds)
	handed := time.Now()
	second := mrproc.Start(t, n.Cfg, n.args()...)
	wait.For(t, registerTimeout, "the second instance to take over", func() bool {
		return second.Count("took over the registration directory from the previous instance", "") == 1
	})
	wait.Never(t, 5*time.Second, "a change of the condition", func() bool { return n.changesSince(handed) > 0 })
	if w := writes(t, second); w != 0 {
		t.Errorf("the new instance wrote the condition %v times", w)
	}
	if c := n.now(); !c.LastTransitionTime.Equal(&on.Cond.LastTransitionTime) {
		t.Errorf("transition time %s, was %s", c.LastTransitionTime, on.Cond.LastTransitionTime)
	}
	stop(t, first, second)
}

// TestAPIServerGone: with the API server stopped for 30 s, registration works as ever (a
// driver that comes meanwhile is registered), and once it is back the condition says what
// kubelet holds then, within bound.
func TestAPIServerGone(t *testing.T) {
	// Not parallel: it stops the API server every test shares.
	n := newNode(t)
	// b is a DRA driver: kubelet's CSI handler needs the API server to register a CSI driver
	// (it writes CSINode); multireg never does.
	a, b := required("before.example.com", "DRAPlugin"), required("during.example.com", "DRAPlugin")
	n.StartEndpoints([]driver{a})
	start := time.Now()
	p := n.start([]driver{a, b})
	n.await("the condition False: the second driver's endpoint is not there", start, isFalse(b.Name))
	api.cp.StopAPIServer()
	stopped := time.Now()
	t.Cleanup(func() { api.cp.StartAPIServer(context.Background()) }) // for the other tests, whatever happens here
	n.StartEndpoint(b)
	wait.For(t, registerTimeout, "kubelet to register the driver without the API server", func() bool {
		return n.K.Registered(b.Name) && p.Phase(b.Name) == "Registered"
	})
	t.Logf("the driver registered %s after the API server stopped", time.Since(stopped).Round(time.Millisecond))
	wait.Never(t, 30*time.Second-time.Since(stopped), "multireg to exit", func() bool { return p.Exited() })
	if err := api.cp.StartAPIServer(t.Context()); err != nil {
		t.Fatal(err)
	}
	ready := time.Now()
	// multireg may write before the API server says it is ready (/readyz): from the stop on.
	back := n.await("the condition True once the API server is back", stopped, isTrue)
	t.Logf("True %s after the API server said it was ready again (a negative figure: before)", back.At.Sub(ready).Round(time.Millisecond))
	// Its retries back off to 8 s at most, ±20%.
	if d := back.At.Sub(ready); d > 12*time.Second {
		t.Errorf("the condition caught up %s after the API server was back, want within 12 s", d)
	}
	// Synced again, with nothing failing: the outage's error is no longer the last word.
	var nc mrproc.NodeConditionStatus
	wait.For(t, registerTimeout, "the status synced, with no error left", func() bool {
		nc, _ = p.Status(t).NodeCondition()
		return nc.Synced && nc.LastError == ""
	})
	stop(t, p)
}

// hasTaint reports whether ts has a taint of want's key, value and effect.
func hasTaint(ts []corev1.Taint, want corev1.Taint) bool {
	for _, t := range ts {
		if t.Key == want.Key && t.Value == want.Value && t.Effect == want.Effect {
			return true
		}
	}
	return false
}

// lastRegistration is when kubelet last registered one of ds.
func lastRegistration(k *kubelet.Kubelet, ds []driver) time.Time {
	var last time.Time
	for _, d := range ds {
		for _, e := range k.EventsFor(d.Name) {
			if e.Kind == kubelet.EventRegister && e.Time.After(last) {
				last = e.Time
			}
		}
	}
	return last
}

// firstEvent is when kubelet first called its handler for name with kind.
func firstEvent(k *kubelet.Kubelet, name string, kind kubelet.EventKind) time.Time {
	for _, e := range k.EventsFor(name) {
		if e.Kind == kind {
			return e.Time
		}
	}
	return time.Time{}
}

// stop stops each multireg with SIGTERM and expects exit 0.
func stop(t *testing.T, ps ...*mrproc.Process) {
	t.Helper()
	for _, p := range ps {
		p.Signal(t, syscall.SIGTERM)
		if code := p.Wait(t, exitTimeout); code != 0 {
			t.Errorf("multireg exited %d on SIGTERM, want 0", code)
		}
	}
}

// writes is how many writes of the condition p made that succeeded.
func writes(t *testing.T, p *mrproc.Process) float64 {
	t.Helper()
	return mrproc.Metric(p.Metrics(t), `multireg_node_condition_writes_total{condition="`+condType+`",result="success"}`)
}

// TestUninstallSaysUnknown: multireg stopped with --cleanup-on-exit (an uninstall) withdraws
// every registration, and says so on the Node: Unknown, not a True nobody keeps.
func TestUninstallSaysUnknown(t *testing.T) {
	t.Parallel()
	n := newNode(t)
	d := required("uninstalled.example.com", "DRAPlugin")
	p, on := n.running([]driver{d}, "--cleanup-on-exit")
	stop(t, p)
	off := n.await("the condition Unknown", on.At, func(c *corev1.NodeCondition) bool {
		return c != nil && c.Status == corev1.ConditionUnknown && c.Reason == "MultiregStopped"
	})
	t.Logf("Unknown: %q", off.Cond.Message)
}

// TestAgentStartedAgain: the node condition's agent, the one process that speaks to the API
// server, ended (killed) is started again; the condition follows kubelet as before, and
// /status counts the agents started. Registration never noticed.
func TestAgentStartedAgain(t *testing.T) {
	t.Parallel()
	n := newNode(t)
	d := required("agent.example.com", "DRAPlugin")
	p, _ := n.running([]driver{d})
	agent := childOf(t, p.PID(), "multireg-nodecond")
	if err := syscall.Kill(agent, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	wait.For(t, registerTimeout, "a second agent", func() bool {
		c, ok := p.Status(t).NodeCondition()
		return ok && c.Agent.Starts == 2 && c.Agent.Running
	})
	gone := time.Now()
	n.StopEndpoint(d)
	n.await("the condition False through the second agent", gone, isFalse(d.Name, "endpoint is gone"))
	if p.Count("the node condition's agent ended; it is started again", "") != 1 {
		t.Error("multireg did not say the agent ended")
	}
	if !n.K.Registered(d.Name) {
		t.Error("kubelet lost the registration")
	}
	stop(t, p)
}

// TestAgentCannotStart: a kubeconfig the agent cannot read stops multireg's start, exit 1,
// with the agent's own words; nothing is registered.
func TestAgentCannotStart(t *testing.T) {
	t.Parallel()
	n := newNode(t)
	d := required("never.example.com", "DRAPlugin")
	n.StartEndpoints([]driver{d})
	p := mrproc.Start(t, n.WriteConfig([]driver{d}), "--node-condition", condType, "--node-name", n.name, "--kubeconfig", "/nonexistent/kubeconfig")
	if code := p.Wait(t, registerTimeout); code != 1 {
		t.Fatalf("exit %d, want 1", code)
	}
	if !strings.Contains(p.Logs(), "--kubeconfig /nonexistent/kubeconfig") {
		t.Errorf("the error does not name the kubeconfig:\n%s", p.Logs())
	}
	if n.K.Registered(d.Name) {
		t.Error("a driver was registered by a multireg that could not start")
	}
}

// childOf returns the pid of parent's child process named name, once there is one.
func childOf(t *testing.T, parent int, name string) int {
	t.Helper()
	var pid int
	wait.For(t, registerTimeout, "the agent process", func() bool {
		var ok bool
		pid, ok = child.Named(parent, name)
		return ok
	})
	return pid
}
