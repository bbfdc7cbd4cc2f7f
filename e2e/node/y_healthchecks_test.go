package node_test

// This file's name begins with y_ so that TestHealthChecks runs after TestThirdParty and before
// TestNodeCondition (z_): Go runs a package's tests in the order of their files' names. It
// leaves nothing registered when it ends (the uninstall withdraws every socket).

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"helm.sh/helm/v3/pkg/action"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"multireg.dev/multireg/e2e/node/images"
)

// The drivers' health checks on the node (docs/health-checks.md): multireg installed with the
// chart's healthChecks (its pod on the host's network, --health-endpoint=:9810), and Kubernetes'
// own e2e mock CSI driver (csimock, build-thirdparty.sh) as a pod of its own on the host's
// network, without a livenessprobe sidecar: its container's livenessProbe is an httpGet of
// /healthz/<driver> on multireg's port, as the docs' snippet has it.
const (
	hcDriver    = "hc.mock.multireg.test"
	hcPod       = "hc-csi-mock"
	hcPodNS     = "default"
	hcContainer = "csi-driver"
	hcHTTPPort  = 9809 // the chart's httpPort: multireg's /status, on the node's address
	hcPort      = 9810 // the chart's healthChecks.port
	// The driver's probe: a check every hcPeriod s, hcFailures failures in a row restart the
	// container; each check bounded by the driver's healthTimeout in multireg (hcHealthTimeout),
	// below the probe's own timeout (hcProbeTimeout), as the docs say to set them.
	hcPeriod        = 2
	hcFailures      = 3
	hcProbeTimeout  = 2
	hcHealthTimeout = 500 * time.Millisecond
	hcGrace         = 1 // the driver pod's terminationGracePeriodSeconds
	hcRollouts      = 20
	// hcMargin is what the restart of a hung driver may take beyond its probe's
	// hcFailures×hcPeriod + hcPeriod (the first failing check comes up to a period after the
	// hang): the last check's hcHealthTimeout; the grace period, which a stopped process spends
	// whole (SIGTERM stays pending on it, SIGKILL ends it); and 4 s for kubelet to act on the
	// probe's result and containerd to kill and start the container on this loaded 2-core
	// machine (pods of TestThirdParty ran within 0.5 s of their creation, an idle moment's
	// figure).
	hcMargin = hcHealthTimeout + hcGrace*time.Second + 4*time.Second
)

// TestHealthChecks: multireg's DaemonSet rolled hcRollouts times while the driver runs, its
// probe pointed at multireg: the driver's container never restarts; kubelet's failed liveness
// probes, its Unhealthy events and the checks of a client of the test (every 100 ms) are counted
// and reported. Then the driver's process stopped (SIGSTOP, from the host, as a hung driver):
// kubelet restarts its container within hcFailures×hcPeriod + hcPeriod + hcMargin, and the new
// container is checked alive again.
func TestHealthChecks(t *testing.T) {
	for _, port := range []int{hcHTTPPort, hcPort} {
		l, err := net.Listen("tcp", ":"+strconv.Itoa(port))
		if err != nil {
			t.Fatalf("the chart's port %d on this machine: %v (multireg's pod on the host's network needs it)", port, err)
		}
		l.Close()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	// The mock's image: the static binary build-thirdparty.sh built, alone, pushed to the
	// test's registry.
	mockImage := images.Image{Ref: reg.Host + "/csimock:e2e", Files: []images.File{{Path: "/csimock", Source: filepath.Join(*thirdparty, "csimock"), Mode: 0o755}}, Entrypoint: []string{"/csimock"}}
	if _, err := mockImage.Push(ctx); err != nil {
		t.Fatal(err)
	}
	sockDir := filepath.Join(cl.PluginsDir, "hc-mock")
	t.Cleanup(func() { hcUninstall(t, sockDir) })
	start := time.Now()
	helmInstall(t, hcValues(sockDir, false))
	mr := multiregPod(t)
	t.Logf("helm install with healthChecks: pod %s on the host's network (pod IP %s, hostNetwork %v) %dms after the install", mr.Name, mr.Status.PodIP, mr.Spec.HostNetwork, ms(time.Since(start)))
	if !mr.Spec.HostNetwork {
		t.Fatalf("multireg's pod is not on the host's network with healthChecks.enabled")
	}

	driver := runPod(t, hcDriverPod(mockImage.Ref, sockDir))
	t.Logf("driver pod %s runs (pod IP %s: the node's address, where kubelet probes %s)", driver.Name, driver.Status.PodIP, "/healthz/"+hcDriver)
	waitRegisteredAt(t, "multireg in pod "+mr.Name, hcStatusURL(mr), hcDriver)
	waitUntil(t, time.Minute, "CSINode lists "+hcDriver, func(ctx context.Context) (bool, string) {
		d, err := csiNodeDrivers(ctx)
		_, ok := d[hcDriver]
		return ok, fmt.Sprint(d, err)
	})
	uid := string(driver.UID)
	waitUntil(t, time.Minute, "kubelet's liveness probe of the driver succeeds", func(ctx context.Context) (bool, string) {
		pc, err := kubeletProbes(ctx, uid, hcContainer, "Liveness")
		return err == nil && pc.Successful > 0 && pc.Failed == 0, fmt.Sprintf("%+v %v", pc, err)
	})
	if code, body := hcCheck(ctx); code != http.StatusOK {
		t.Fatalf("GET /healthz/%s: %d %q; want 200", hcDriver, code, body)
	}

	// Each whatever the other's verdict: a rollout without a hand-over (a failure of the first)
	// leaves the driver's pod as it was for the second.
	scenario(t, "hc-rollouts-driver-untouched", func(t *testing.T) { hcRolloutsUntouched(t, uid) })
	scenario(t, "hc-hung-driver-restarted", func(t *testing.T) { hcHungDriverRestarted(t, uid) })
}

// hcValues are the chart's values: the node's kubelet root, the image `make image` built (by its
// index digest), the mock as the one driver (its healthTimeout hcHealthTimeout), the health
// checks on; the node condition off (TestNodeCondition's: without it the chart makes no
// cluster-wide object, and this test needs none).
func hcValues(sockDir string, cleanup bool) map[string]any {
	return map[string]any{
		"kubeletDir": cl.KubeletRoot,
		"image":      map[string]any{"repository": underTest.Repo, "digest": underTest.Digest.String()},
		"defaults":   map[string]any{"backoff": map[string]any{"initialInterval": "500ms", "maxInterval": "2s"}},
		"drivers": []any{map[string]any{
			"name": hcDriver, "type": "CSIPlugin", "endpoint": filepath.Join(sockDir, "csi.sock"),
			"healthTimeout": hcHealthTimeout.String(),
		}},
		"healthChecks":  map[string]any{"enabled": true, "port": hcPort},
		"nodeCondition": map[string]any{"enabled": false},
		"cleanupOnExit": cleanup,
	}
}

// helmInstall installs the chart as release ncRelease (what TestNodeCondition installs later,
// once this one is gone).
func helmInstall(t *testing.T, vals map[string]any) {
	t.Helper()
	(&ncEnv{}).helm(t, true, vals)
}

// hcStatusURL is multireg's /status on the host's network: the pod IP is the node's address.
func hcStatusURL(pod corev1.Pod) string {
	return fmt.Sprintf("http://%s:%d/status", pod.Status.PodIP, hcHTTPPort)
}

// hcDriverPod is the mock CSI driver as a node plugin's pod: on the host's network, its socket
// in a host directory below kubelet's plugins directory (which multireg's pod mounts), no
// sidecar; its livenessProbe is the docs' snippet.
func hcDriverPod(image, sockDir string) *corev1.Pod {
	p := pausePod(hcPod, hcPodNS)
	grace := int64(hcGrace)
	dirOrCreate := corev1.HostPathDirectoryOrCreate
	p.Spec.TerminationGracePeriodSeconds = &grace
	p.Spec.HostNetwork = true
	p.Spec.Volumes = []corev1.Volume{{Name: "socket-dir", VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: sockDir, Type: &dirOrCreate}}}}
	p.Spec.Containers = []corev1.Container{{
		Name:            hcContainer,
		Image:           image,
		ImagePullPolicy: corev1.PullIfNotPresent,
		Args:            []string{"-endpoint", "/csi/csi.sock", "-name", hcDriver},
		VolumeMounts:    []corev1.VolumeMount{{Name: "socket-dir", MountPath: "/csi"}},
		LivenessProbe: &corev1.Probe{
			ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{
				Path: "/healthz/" + hcDriver,   // the driver's name in multireg's drivers file
				Port: intstr.FromInt32(hcPort), // healthChecks.port: a number (the port is not this pod's)
			}},
			TimeoutSeconds:   hcProbeTimeout,
			PeriodSeconds:    hcPeriod,
			FailureThreshold: hcFailures,
		},
	}}
	return p
}

// hcCheck asks multireg's health endpoint for the driver, as the probe does (on the node's
// loopback: the endpoint listens on every address).
func hcCheck(ctx context.Context) (int, string) {
	ctx, cancel := context.WithTimeout(ctx, hcProbeTimeout*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, fmt.Sprintf("http://127.0.0.1:%d/healthz/%s", hcPort, hcDriver), nil)
	if err != nil {
		return 0, err.Error()
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, strings.TrimSpace(string(b))
}

// driverPod returns the driver's pod and its container's status.
func driverPod(ctx context.Context) (*corev1.Pod, corev1.ContainerStatus, error) {
	p, err := cl.Client.CoreV1().Pods(hcPodNS).Get(ctx, hcPod, metav1.GetOptions{})
	if err != nil {
		return nil, corev1.ContainerStatus{}, err
	}
	for _, cs := range p.Status.ContainerStatuses {
		if cs.Name == hcContainer {
			return p, cs, nil
		}
	}
	return p, corev1.ContainerStatus{}, fmt.Errorf("pod %s has no status of container %s yet", hcPod, hcContainer)
}

// podEvents returns kubelet's events about the driver's pod of reason (Unhealthy,
// Killing): how many (an event's count included), and their messages.
func podEvents(ctx context.Context, reason string) (int, []string, error) {
	list, err := cl.Client.CoreV1().Events(hcPodNS).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + hcPod + ",reason=" + reason})
	if err != nil {
		return 0, nil, err
	}
	n := 0
	var msgs []string
	for _, e := range list.Items {
		n += max(int(e.Count), 1)
		if !slices.Contains(msgs, e.Message) {
			msgs = append(msgs, e.Message)
		}
	}
	return n, msgs, nil
}

// checker asks multireg's health endpoint for the driver every 100 ms until stopped, as a probe
// would (a new connection each time, its timeout the probe's), and counts what failed.
type checker struct {
	mu       sync.Mutex
	checks   int
	failures []string
	stop     chan struct{}
	done     chan struct{}
}

func startChecker() *checker {
	c := &checker{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(c.done)
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-c.stop:
				return
			case <-tick.C:
			}
			code, body := hcCheck(context.Background())
			c.mu.Lock()
			c.checks++
			if code != http.StatusOK {
				c.failures = append(c.failures, fmt.Sprintf("%s: %d %s", time.Now().UTC().Format("15:04:05.000"), code, body))
			}
			c.mu.Unlock()
		}
	}()
	return c
}

func (c *checker) finish() (checks int, failures []string) {
	close(c.stop)
	<-c.done
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.checks, c.failures
}

// hcRolloutsUntouched rolls multireg's DaemonSet hcRollouts times (kubectl rollout restart and
// rollout status, each once the pod is available, so that each surges and hands over) while
// the driver runs with its probe on multireg: the driver's container must never restart.
func hcRolloutsUntouched(t *testing.T, uid string) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	before, err := kubeletProbes(ctx, uid, hcContainer, "Liveness")
	if err != nil {
		t.Fatal(err)
	}
	unhealthyBefore, _, err := podEvents(ctx, "Unhealthy")
	if err != nil {
		t.Fatal(err)
	}
	chk := startChecker()
	w := watchCSINode(t)
	var took []time.Duration
	var startToReady []int64 // kubelet's log: the new container started → the new pod's readiness probe ready, ms
	handedOver := 0
	for i := 1; i <= hcRollouts; i++ {
		old := waitAvailable(t)
		logFrom := kubeletLogSize(t)
		start := time.Now()
		pod, ready, oldLog, err := restartRelease(t, ctx, old)
		if err != nil {
			chk.finish()
			t.Fatalf("rollout %d: %v", i, err)
		}
		d := ready.Sub(start)
		took = append(took, d)
		kt := kubeletRolloutTimes(t, logFrom, old, pod)
		if kt.readyAfterStart >= 0 {
			startToReady = append(startToReady, kt.readyAfterStart)
		}
		if newLog := podLog(t, pod); strings.Contains(newLog, msgTookOver) {
			handedOver++
		} else {
			marks := []string{"hand", "standing by", "serving the registration directory", "took over", "waiting", "signal", msgStopped, "multireg started"}
			t.Errorf("rollout %d: pod %s's log does not say %q; the old pod %s's log:\n%s\nthe new pod's:\n%s\nkubelet's log (%s):\n%s", i, pod.Name, msgTookOver, old.Name,
				strings.Join(linesWith(oldLog, marks...), "\n"), strings.Join(linesWith(newLog, marks...), "\n"), kt, strings.Join(kt.lines, "\n"))
		}
		t.Logf("rollout %d: kubelet's log: %s", i, kt)
		_, cs, err := driverPod(ctx)
		if err != nil {
			t.Fatal(err)
		}
		pc, _ := kubeletProbes(ctx, uid, hcContainer, "Liveness")
		t.Logf("rollout %d: %s → %s in %dms; the driver's container: restartCount %d; kubelet's liveness probes of it so far %+v", i, old.Name, pod.Name, ms(d), cs.RestartCount, pc)
		if cs.RestartCount != 0 {
			t.Errorf("rollout %d: the driver's container restarted (restartCount %d, last state %+v)", i, cs.RestartCount, cs.LastTerminationState)
		}
	}
	checks, failed := chk.finish()
	gaps := w.catchUp(t)
	t.Logf("%s out of CSINode during the rollouts: %d time(s) %v", hcDriver, len(gaps[hcDriver]), gaps[hcDriver])
	after, err := kubeletProbes(ctx, uid, hcContainer, "Liveness")
	if err != nil {
		t.Fatal(err)
	}
	unhealthyAfter, msgs, err := podEvents(ctx, "Unhealthy")
	if err != nil {
		t.Fatal(err)
	}
	sorted := slices.Clone(took)
	slices.Sort(sorted)
	var total time.Duration
	for _, d := range took {
		total += d
	}
	probeFailed := after.Failed - before.Failed
	if len(startToReady) > 0 {
		s := slices.Clone(startToReady)
		slices.Sort(s)
		t.Logf("kubelet's log, over %d of %d rollouts: the new container started → the new pod's readiness probe ready %d–%dms (median %dms) %v", len(s), len(took), s[0], s[len(s)-1], s[len(s)/2], startToReady)
	}
	t.Logf("%d rollouts (%d handed over): each %dms to %dms (median %dms, mean %dms) from rollout restart to the new pod Ready; kubelet's liveness probes of the driver meanwhile: %d successful, %d failed; Unhealthy events %d %v; the test's own checks every 100 ms: %d, %d failed %v",
		len(took), handedOver, ms(sorted[0]), ms(sorted[len(sorted)-1]), ms(sorted[len(sorted)/2]), ms(total/time.Duration(len(took))),
		after.Successful-before.Successful, probeFailed, unhealthyAfter-unhealthyBefore, msgs, checks, len(failed), failed)
	figures = append(figures,
		fmt.Sprintf("health checks: %d rollouts of multireg (%d handed over), each %d–%dms (median %dms) from rollout restart to the new pod Ready; the driver's container restarted 0 times; kubelet's liveness probes of it %d successful, %d failed; %d Unhealthy events; the test's checks every 100 ms %d, %d failed; the driver out of CSINode %d time(s) %v",
			len(took), handedOver, ms(sorted[0]), ms(sorted[len(sorted)-1]), ms(sorted[len(sorted)/2]), after.Successful-before.Successful, probeFailed, unhealthyAfter-unhealthyBefore, checks, len(failed), len(gaps[hcDriver]), gaps[hcDriver]))
	_, cs, err := driverPod(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if cs.RestartCount != 0 {
		t.Errorf("the driver's container restarted %d times over the rollouts; want 0", cs.RestartCount)
	}
}

// containerPID returns the host PID of the container's task, as the node's containerd knows it
// (ctr task ls), from its containerID (containerd://ID).
func containerPID(ctx context.Context, containerID string) (int, error) {
	id := strings.TrimPrefix(containerID, "containerd://")
	out, err := exec.CommandContext(ctx, "ctr", "--address", cl.ContainerdAddress, "--namespace", "k8s.io", "task", "ls").CombinedOutput()
	if err != nil {
		return 0, fmt.Errorf("ctr task ls: %w: %s", err, out)
	}
	for _, l := range strings.Split(string(out), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == id {
			return strconv.Atoi(f[1])
		}
	}
	return 0, fmt.Errorf("no task of container %s in ctr task ls:\n%s", id, out)
}

// procState is the state letter of the process pid (R, S, T for stopped, Z), "" once it is gone.
func procState(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return ""
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 || i+2 >= len(s) {
		return "?"
	}
	return s[i+2 : i+3]
}

// hcHungDriverRestarted stops the driver's process (SIGSTOP from the host: it holds its socket
// and answers nothing, as a hung driver) and measures, polling every 50 ms, when kubelet's
// liveness probe first failed, when the process was gone and when the container ran again;
// kubelet must restart it within hcFailures×hcPeriod + hcPeriod + hcMargin.
func hcHungDriverRestarted(t *testing.T, uid string) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	_, cs, err := driverPod(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if cs.State.Running == nil {
		t.Fatalf("the driver's container is not running: %+v", cs.State)
	}
	pid, err := containerPID(ctx, cs.ContainerID)
	if err != nil {
		t.Fatal(err)
	}
	comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
	if strings.TrimSpace(string(comm)) != "csimock" {
		t.Fatalf("the driver container's task is PID %d, %q; want csimock", pid, comm)
	}
	restartsBefore := cs.RestartCount
	probesBefore, err := kubeletProbes(ctx, uid, hcContainer, "Liveness")
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	stopped := time.Now()
	t.Cleanup(func() { _ = syscall.Kill(pid, syscall.SIGCONT) }) // were it still there: the pod's deletion ends it
	var firstFail, gone, running time.Time
	var probes probeCount
	var checkCode int
	var checkBody string
	bound := hcFailures*hcPeriod*time.Second + hcPeriod*time.Second + hcMargin
	waitUntil(t, bound+time.Minute, "kubelet restarts the hung driver's container", func(ctx context.Context) (bool, string) {
		now := time.Now()
		if pc, err := kubeletProbes(ctx, uid, hcContainer, "Liveness"); err == nil {
			probes = pc
			if firstFail.IsZero() && pc.Failed > probesBefore.Failed {
				firstFail = now
			}
		}
		state := procState(pid)
		if gone.IsZero() && state == "" {
			gone = now
		}
		_, cs, err := driverPod(ctx)
		if err != nil {
			return false, err.Error()
		}
		if running.IsZero() && cs.RestartCount > restartsBefore && cs.State.Running != nil {
			running = now
		}
		return !running.IsZero(), fmt.Sprintf("process %d state %q; container restartCount %d, state %+v; kubelet's liveness probes %+v", pid, state, cs.RestartCount, cs.State, probes)
	})
	// What the probe got meanwhile, asked once the driver is back: kubelet's events.
	_, unhealthy, _ := podEvents(ctx, "Unhealthy")
	_, killing, _ := podEvents(ctx, "Killing")
	took := running.Sub(stopped)
	failedProbes := probes.Failed - probesBefore.Failed
	at := func(tm time.Time) string {
		if tm.IsZero() {
			return "not seen"
		}
		return fmt.Sprintf("%dms", ms(tm.Sub(stopped)))
	}
	t.Logf("driver process %d stopped (SIGSTOP): kubelet's first failed liveness probe seen at %s, the process gone at %s, the container running again (restartCount %d → %d) at %dms; %d failed probes in between; bound %dms (%d×%ds + %ds + margin %dms); Unhealthy %v; Killing %v",
		pid, at(firstFail), at(gone), restartsBefore, restartsBefore+1, ms(took), failedProbes, ms(bound), hcFailures, hcPeriod, hcPeriod, ms(hcMargin), unhealthy, killing)
	if took > bound {
		t.Errorf("the hung driver's container ran again %s after it hung; want within %s (failureThreshold %d × periodSeconds %d + periodSeconds + %s)", took, bound, hcFailures, hcPeriod, hcMargin)
	}
	if failedProbes < hcFailures {
		t.Errorf("kubelet counted %d failed liveness probes before the restart; want at least failureThreshold, %d", failedProbes, hcFailures)
	}
	if !slices.ContainsFunc(unhealthy, func(m string) bool { return strings.Contains(m, "statuscode: 500") }) {
		t.Errorf("kubelet's Unhealthy events of the driver: %v; want multireg's 500 (the check's healthTimeout before the probe's timeout)", unhealthy)
	}
	// The new process: registered as before, and checked alive by kubelet.
	waitUntil(t, time.Minute, "the restarted driver checked alive again", func(ctx context.Context) (bool, string) {
		checkCode, checkBody = hcCheck(ctx)
		pc, err := kubeletProbes(ctx, uid, hcContainer, "Liveness")
		return err == nil && checkCode == http.StatusOK && pc.Successful > probes.Successful, fmt.Sprintf("GET: %d %q; kubelet's liveness probes %+v %v", checkCode, checkBody, pc, err)
	})
	figures = append(figures, fmt.Sprintf("health checks: a hung driver (SIGSTOP) restarted by kubelet %dms after it hung (first failed probe at %s, process gone at %s; %d failed probes; probe period %ds, failureThreshold %d, healthTimeout %s; bound %dms)",
		ms(took), at(firstFail), at(gone), failedProbes, hcPeriod, hcFailures, hcHealthTimeout, ms(bound)))
}

// hcUninstall deletes the driver's pod and uninstalls the release as docs/deploy.md says
// (cleanupOnExit, the rollout, then helm uninstall), so that every registration socket goes and
// kubelet deregisters the driver; then removes the driver's socket directory.
func hcUninstall(t *testing.T, sockDir string) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	if t.Failed() {
		if pods, err := multiregPods(ctx); err == nil {
			for _, p := range pods {
				out, _ := cl.Kubectl(ctx, "logs", "-n", ncNS, p.Name, "--tail=60")
				t.Logf("the last lines of pod %s's log:\n%s", p.Name, out)
			}
		}
		out, _ := cl.Kubectl(ctx, "logs", "-n", hcPodNS, hcPod, "--tail=20")
		t.Logf("the last lines of the driver's log:\n%s", out)
	}
	pods := cl.Client.CoreV1().Pods(hcPodNS)
	if err := pods.Delete(ctx, hcPod, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		t.Errorf("delete pod %s: %v", hcPod, err)
	}
	if _, err := action.NewGet(helmConfig(t)).Run(ncRelease); err == nil {
		(&ncEnv{}).helm(t, false, hcValues(sockDir, true))
		if out, err := cl.Kubectl(ctx, "rollout", "status", "-n", ncNS, "ds/"+ncRelease, "--timeout=2m"); err != nil {
			t.Errorf("rollout with cleanupOnExit: %v\n%s", err, out)
		}
		un := action.NewUninstall(helmConfig(t))
		un.Wait, un.DeletionPropagation, un.Timeout = true, "foreground", 2*time.Minute
		if _, err := un.Run(ncRelease); err != nil {
			t.Errorf("helm uninstall: %v", err)
		}
		waitNoPods(t)
	}
	waitUntil(t, 2*time.Minute, "pod "+hcPod+" gone and kubelet no longer lists "+hcDriver, func(ctx context.Context) (bool, string) {
		_, err := pods.Get(ctx, hcPod, metav1.GetOptions{})
		d, derr := csiNodeDrivers(ctx)
		_, listed := d[hcDriver]
		return apierrors.IsNotFound(err) && derr == nil && !listed, fmt.Sprintf("pod: %v; CSINode: %v %v", err, d, derr)
	})
	if err := os.Remove(sockDir); err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the driver's socket directory after it stopped: %v", err)
	}
}

// rolloutTimes is what kubelet's log (--v=2) says of one rollout: when the new pod's multireg
// container started (its PLEG event), when its readiness probe first said ready, when the old
// pod's deletion reached kubelet; each -1 when not found.
type rolloutTimes struct {
	readyAfterStart, deletedAfterStart int64 // ms
	lines                              []string
}

func (r rolloutTimes) String() string {
	f := func(v int64) string {
		if v < 0 {
			return "not found"
		}
		return fmt.Sprintf("%dms", v)
	}
	return fmt.Sprintf("the new container started → its pod's readiness probe ready %s, → the old pod's SyncLoop DELETE %s", f(r.readyAfterStart), f(r.deletedAfterStart))
}

// kubeletRolloutTimes reads kubelet's log from offset: the PLEG event of the new pod's container
// starting (by its container ID), the new pod's first readiness probe "ready" after it, and
// the old pod's "SyncLoop DELETE".
func kubeletRolloutTimes(t *testing.T, offset int64, old, pod corev1.Pod) rolloutTimes {
	t.Helper()
	r := rolloutTimes{readyAfterStart: -1, deletedAfterStart: -1}
	var cid string
	for _, cs := range pod.Status.ContainerStatuses {
		if cs.Name == "multireg" {
			cid = strings.TrimPrefix(cs.ContainerID, "containerd://")
		}
	}
	b := kubeletLogSince(t, offset)
	// klog's header: I1129 10:47:11.123456 (no year: differences only).
	at := func(l string) (time.Time, bool) {
		if len(l) < 22 {
			return time.Time{}, false
		}
		tm, err := time.Parse("0102 15:04:05.000000", l[1:21])
		return tm, err == nil
	}
	newRef, oldRef := `"`+ncNS+"/"+pod.Name+`"`, `"`+ncNS+"/"+old.Name+`"`
	var started, ready, deleted time.Time
	for _, l := range strings.Split(string(b), "\n") {
		switch {
		case cid != "" && started.IsZero() && strings.Contains(l, "SyncLoop (PLEG)") && strings.Contains(l, "ContainerStarted") && strings.Contains(l, cid):
			started, _ = at(l)
			r.lines = append(r.lines, l)
		case ready.IsZero() && strings.Contains(l, "SyncLoop (probe)") && strings.Contains(l, `probe="readiness"`) && strings.Contains(l, `status="ready"`) && strings.Contains(l, "pod="+newRef):
			ready, _ = at(l)
			r.lines = append(r.lines, l)
		case deleted.IsZero() && strings.Contains(l, "SyncLoop DELETE") && strings.Contains(l, oldRef):
			deleted, _ = at(l)
			r.lines = append(r.lines, l)
		}
	}
	if !started.IsZero() && !ready.IsZero() {
		r.readyAfterStart = ms(ready.Sub(started))
	}
	if !started.IsZero() && !deleted.IsZero() {
		r.deletedAfterStart = ms(deleted.Sub(started))
	}
	return r
}
