package node_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"multireg.dev/multireg/e2e/internal/child"
	"multireg.dev/multireg/e2e/node/cluster"
)

// Third-party plugins nobody here wrote, built at pinned versions by build-thirdparty.sh, run
// as host processes that the test owns (started, stopped and awaited here; recorded for
// cmd/cleanup), each with its own registration turned off or pointed away from kubelet, and
// registered by multireg on the host:
//   - csimock: Kubernetes' own e2e mock CSI driver (what kubelet's CSI e2e tests use);
//   - sample-device-plugin: Kubernetes' test image, its socket dp.<unix time> outside
//     plugins_registry, its own Register on kubelet.sock never triggered;
//   - dra-example-kubeletplugin: sigs.k8s.io/dra-example-driver's kubelet plugin, which
//     publishes its ResourceSlices itself; its kubeletplugin helper's registration socket lies
//     in a directory kubelet does not watch.
const (
	mockCSI    = "io.kubernetes.storage.mock" // the mock's own default name; its node ID too
	sampleRes  = "example.com/resource"       // the sample device plugin's resource: 2 devices
	nSample    = 2
	gpuDriver  = "gpu.example.com" // dra-example-driver's driver and DeviceClass
	gpuDemoNS  = "gpu-test1"       // the namespace of its demo spec gpu-test1.yaml
	gpuDemoRCT = "single-gpu"      // the ResourceClaimTemplate of that spec
)

// hostPlugin is a third-party plugin run as a host process.
type hostPlugin struct {
	*child.Process
	log string
}

// startPlugin starts bin of the third-party directory with env added, its output in log, and
// stops it (SIGTERM, awaited) when the test ends.
func startPlugin(t *testing.T, name, log, bin string, env []string, args ...string) *hostPlugin {
	t.Helper()
	p, err := cluster.StartProcEnv(name, log, filepath.Join(*thirdparty, bin), env, args...)
	if err != nil {
		t.Fatal(err)
	}
	hp := &hostPlugin{Process: p, log: log}
	t.Cleanup(func() {
		hp.stop(t)
		if t.Failed() {
			t.Logf("%s: last lines of %s:\n%s", name, log, cluster.Tail(log, 15))
		}
	})
	if err := cl.Track(name, p.PID()); err != nil {
		t.Fatal(err)
	}
	return hp
}

func (p *hostPlugin) stop(t *testing.T) {
	t.Helper()
	if err := p.Stop(15 * time.Second); err != nil {
		t.Errorf("%v; log:\n%s", err, cluster.Tail(p.log, 20))
	}
}

// lines returns how many lines of the plugin's log hold every one of parts.
func (p *hostPlugin) lines(parts ...string) int { return logLines(p.log, parts...) }

// logLines returns how many lines of the file hold every one of parts.
func logLines(path string, parts ...string) int {
	b, _ := os.ReadFile(path)
	n := 0
	for _, l := range strings.Split(string(b), "\n") {
		all := true
		for _, s := range parts {
			all = all && strings.Contains(l, s)
		}
		if all {
			n++
		}
	}
	return n
}

// waitSocket waits until path exists, as the plugin's own listener made it.
func waitSocket(t *testing.T, p *hostPlugin, path string) {
	t.Helper()
	waitUntil(t, 30*time.Second, p.log+": socket "+path, func(context.Context) (bool, string) {
		if p.Exited() {
			t.Fatalf("exited: %v; log:\n%s", p.Err(), cluster.Tail(p.log, 20))
		}
		_, err := os.Stat(path)
		return err == nil, fmt.Sprint(err)
	})
}

// startCSIMock starts the mock CSI driver on endpoint; log names its log (one per process).
func startCSIMock(t *testing.T, endpoint, log string) *hostPlugin {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(endpoint), 0o755); err != nil {
		t.Fatal(err)
	}
	p := startPlugin(t, "csimock", log, "csimock", nil, "-endpoint", endpoint, "-name", mockCSI)
	waitSocket(t, p, endpoint)
	return p
}

// csiCalls counts the calls of a CSI Node method that the mock answered without error, from
// its own log of every call (`gRPCCall: {"Method":…,"Error":""…}`).
func csiCalls(p *hostPlugin, method string) int {
	return p.lines(`gRPCCall: {"Method":"/csi.v1.Node/`+method+`"`, `"Error":""`)
}

// startSampleDevicePlugin starts the sample device plugin with its socket in dir and returns
// its socket: dp.<unix time of the start>. REGISTER_CONTROL_FILE names a file that never goes
// away, so the plugin never calls Register on kubelet.sock itself.
func startSampleDevicePlugin(t *testing.T, dir, log string) (*hostPlugin, string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	env := []string{"PLUGIN_SOCK_DIR=" + dir, "REGISTER_CONTROL_FILE=" + filepath.Join(filepath.Dir(log), "sample-dp.never-removed")}
	p := startPlugin(t, "sample-device-plugin", log, "sample-device-plugin", env)
	var sock string
	waitUntil(t, 30*time.Second, "the sample device plugin's socket in "+dir, func(context.Context) (bool, string) {
		if p.Exited() {
			t.Fatalf("exited: %v; log:\n%s", p.Err(), cluster.Tail(p.log, 20))
		}
		m, _ := filepath.Glob(filepath.Join(dir, "dp.*"))
		if len(m) != 1 || p.lines("Starting to serve on socket") == 0 {
			return false, fmt.Sprintf("sockets %v", m)
		}
		sock = m[0]
		return true, ""
	})
	return p, sock
}

// restartSampleDevicePlugin stops the sample device plugin and starts it again in the same
// directory, a second later at least so that its socket gets a new name, which it returns.
func restartSampleDevicePlugin(t *testing.T, p *hostPlugin, dir, oldSock, log string) (*hostPlugin, string) {
	t.Helper()
	p.stop(t)
	started, err := strconv.ParseInt(strings.TrimPrefix(filepath.Base(oldSock), "dp."), 10, 64)
	if err != nil {
		t.Fatalf("sample device plugin socket %s: %v", oldSock, err)
	}
	waitUntil(t, 5*time.Second, "the next second (the socket's name is the start's unix time)", func(context.Context) (bool, string) {
		return time.Now().Unix() > started, ""
	})
	return startSampleDevicePlugin(t, dir, log)
}

// startDRAExample starts dra-example-kubeletplugin for the node: its DRA service socket is
// pluginsDir/gpu.example.com/dra.sock, its own registration socket goes to registrarDir (which
// kubelet does not watch), its CDI specs to cdiDir; env is added to its environment (for a
// second instance, POD_UID=…, which dra-example-driver v0.2.1 does not read: its helper has
// no rolling-update mode). It returns the DRA service socket.
func startDRAExample(t *testing.T, name, log, pluginsDir, registrarDir, cdiDir string, env ...string) (*hostPlugin, string) {
	t.Helper()
	if err := os.MkdirAll(registrarDir, 0o755); err != nil {
		t.Fatal(err)
	}
	p := startPlugin(t, name, log, "dra-example-kubeletplugin", env,
		"--node-name", cluster.NodeName, "--kubeconfig", cl.Kubeconfig, "--cdi-root", cdiDir,
		"--kubelet-registrar-directory-path", registrarDir, "--kubelet-plugins-directory-path", pluginsDir)
	sock := filepath.Join(pluginsDir, gpuDriver, "dra.sock")
	waitSocket(t, p, sock)
	return p, sock
}

// TestThirdParty registers the three third-party plugins through multireg on the host and
// uses each: an inline ephemeral CSI volume, a DRA claim from dra-example-driver's own
// ResourceClaimTemplate, a device of the sample device plugin; then the CSI driver restarts.
func TestThirdParty(t *testing.T) {
	dir := tempDir(t)
	csiSock := endpointPath("csi-mock", "csi.sock")
	dpDir := filepath.Join(cl.PluginsDir, "sample-dp")
	// The sample device plugin creates its fake device files in /tmp when kubelet allocates:
	// removed afterwards unless they were there before.
	for _, f := range []string{"/tmp/Dev-1", "/tmp/Dev-2"} {
		if _, err := os.Lstat(f); os.IsNotExist(err) {
			t.Cleanup(func() { _ = os.Remove(f) })
		}
	}
	mock := startCSIMock(t, csiSock, filepath.Join(dir, "csimock.1.log"))
	dp, dpSock := startSampleDevicePlugin(t, dpDir, filepath.Join(dir, "sample-dp.1.log"))
	draRegistrar := filepath.Join(dir, "dra-registrar")
	dra, draSock := startDRAExample(t, "dra-example", filepath.Join(dir, "dra-example.1.log"), cl.PluginsDir, draRegistrar, filepath.Join(dir, "cdi"))
	for _, s := range []string{csiSock, dpSock, draSock} {
		if strings.HasPrefix(s, cl.PluginsRegistry+"/") {
			t.Fatalf("%s lies in kubelet's plugins_registry: kubelet would register it by itself", s)
		}
	}

	config := filepath.Join(dir, "config.yaml")
	writeFileAtomic(t, config, hostConfig(
		driverEntry(mockCSI, "CSIPlugin", csiSock),
		// Its socket is dp.<unix time of the start>: a pattern follows it across restarts.
		driverEntry(sampleRes, "DevicePlugin", filepath.Join(dpDir, "dp.*")),
		driverEntry(gpuDriver, "DRAPlugin", draSock)))
	mrStart := time.Now()
	// -v 1: multireg logs when it has recorded a CSI driver's NodeGetInfo (scenario 9).
	mr := startHostMultireg(t, config, "-v", "1", "--cleanup-on-exit")

	ok := scenario(t, "6-thirdparty-registered", func(t *testing.T) {
		waitAllRegistered(t, mr, mockCSI, sampleRes, gpuDriver)
		waitKubeletHolds(t, mockCSI, sampleRes, gpuDriver)
		waitUntil(t, 60*time.Second, "CSINode lists "+mockCSI+" with its node ID", func(ctx context.Context) (bool, string) {
			drivers, err := csiNodeDrivers(ctx)
			return err == nil && drivers[mockCSI] == mockCSI, fmt.Sprint(drivers, err)
		})
		waitUntil(t, 60*time.Second, "node capacity "+sampleRes, func(ctx context.Context) (bool, string) {
			c, a, err := capacity(ctx, sampleRes)
			return err == nil && c == nSample && a == nSample, fmt.Sprintf("capacity %d, allocatable %d %v", c, a, err)
		})
		t.Logf("the three third-party plugins registered, in CSINode and node capacity %.1fs after multireg started", time.Since(mrStart).Seconds())
		if n := csiCalls(mock, "NodeGetInfo"); n < 1 {
			t.Errorf("the mock CSI driver answered NodeGetInfo %d times; kubelet's CSI handler asks once per registration", n)
		}
		if n := dp.lines(`"ListAndWatch"`); n < 1 {
			t.Errorf("kubelet's device manager never called the sample device plugin's ListAndWatch")
		}
		if n := dp.lines("Device Plugin registered with the Kubelet"); n != 0 {
			t.Errorf("the sample device plugin registered itself on kubelet.sock (%d times): multireg's registration is not the one tested", n)
		}
		if m, _ := filepath.Glob(filepath.Join(draRegistrar, "*")); len(m) == 0 {
			t.Errorf("dra-example-kubeletplugin's own registration socket is not in %s", draRegistrar)
		}
	}) &&
		scenario(t, "7-csi-mock-inline-ephemeral-volume", func(t *testing.T) { inlineVolumePod(t, mock, "e2e-inline") }) &&
		scenario(t, "8-dra-example-claim-from-template", func(t *testing.T) { draExampleClaim(t, dra) }) &&
		scenario(t, "9-sample-device-plugin-device", func(t *testing.T) { sampleDevicePod(t, dp) })
	if !ok {
		return
	}
	_ = scenario(t, "10-csi-mock-restart", func(t *testing.T) { csiMockRestart(t, mr, mock, csiSock, dir) }) &&
		scenario(t, "11-sample-device-plugin-restart", func(t *testing.T) { sampleDevicePluginRestart(t, mr, dp, dpDir, dpSock, dir) })
}

// sampleDevicePluginRestart restarts the sample device plugin, which comes back under a new
// socket name (dp.<unix time>): multireg, given the pattern dp.*, registers the new socket (a
// device plugin needs a new registration after a restart anyway), the node's allocatable comes
// back, and a pod gets a device from the new process. How long allocatable was short is
// measured from the API server. (With a fixed endpoint, multireg kept the dead socket's
// registration and allocatable stayed at 0.)
func sampleDevicePluginRestart(t *testing.T, mr *hostMultireg, dp *hostPlugin, dpDir, oldSock, dir string) {
	before := waitAllRegistered(t, mr, sampleRes)
	restarted, sock := restartSampleDevicePlugin(t, dp, dpDir, oldSock, filepath.Join(dir, "sample-dp.2.log"))
	start := time.Now()
	var short shortfall // of allocatable devices
	waitUntil(t, time.Minute, "the new socket registered and every device allocatable again", func(ctx context.Context) (bool, string) {
		_, a, err := capacity(ctx, sampleRes)
		if err != nil {
			return false, err.Error()
		}
		short.observe(int(a), nSample)
		st, err := mr.status(ctx)
		if err != nil {
			return false, err.Error()
		}
		s := st[sampleRes]
		return s.Phase == "Registered" && s.Endpoint == sock && a == nSample && time.Since(start) > 3*time.Second,
			fmt.Sprintf("allocatable %d, %+v", a, s)
	})
	if st := waitAllRegistered(t, mr, sampleRes); st[sampleRes].Attempts != before[sampleRes].Attempts+1 {
		t.Errorf("%s: %d sockets published after its restart, want %d (one more)", sampleRes, st[sampleRes].Attempts, before[sampleRes].Attempts+1)
	}
	t.Logf("sample device plugin restart under a new name (%s → %s): registered again; allocatable seen short of %d for %s",
		filepath.Base(oldSock), filepath.Base(sock), nSample, short.total.Round(time.Millisecond))
	figures = append(figures, fmt.Sprintf("sample device plugin restart, new socket name, endpoint pattern dp.*: re-registered; allocatable seen short for %s, longest %dms (node status, polled)", short.total.Round(time.Millisecond), short.longest.Milliseconds()))
	sampleDevicePod(t, restarted)
}

// inlineVolumePod runs a pod with an inline ephemeral volume of the mock CSI driver: kubelet
// calls NodePublishVolume on the endpoint it learnt from multireg's registration, with the
// volume marked ephemeral; deleting the pod makes it call NodeUnpublishVolume.
func inlineVolumePod(t *testing.T, mock *hostPlugin, name string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	no, yes := false, true
	drivers := cl.Client.StorageV1().CSIDrivers()
	if _, err := drivers.Get(ctx, mockCSI, metav1.GetOptions{}); apierrors.IsNotFound(err) {
		// As the driver's deployment would declare it: inline ephemeral volumes, no attach,
		// pod info on mount (which carries csi.storage.k8s.io/ephemeral to the driver).
		_, err := drivers.Create(ctx, &storagev1.CSIDriver{
			ObjectMeta: metav1.ObjectMeta{Name: mockCSI},
			Spec: storagev1.CSIDriverSpec{
				AttachRequired: &no, PodInfoOnMount: &yes,
				VolumeLifecycleModes: []storagev1.VolumeLifecycleMode{storagev1.VolumeLifecycleEphemeral},
			},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = drivers.Delete(context.Background(), mockCSI, metav1.DeleteOptions{}) })
	}
	published, unpublished := csiCalls(mock, "NodePublishVolume"), csiCalls(mock, "NodeUnpublishVolume")
	pod := pausePod(name, "default")
	pod.Spec.Volumes = []corev1.Volume{{Name: "data", VolumeSource: corev1.VolumeSource{CSI: &corev1.CSIVolumeSource{Driver: mockCSI}}}}
	pod.Spec.Containers[0].VolumeMounts = []corev1.VolumeMount{{Name: "data", MountPath: "/data"}}
	start := time.Now()
	runPod(t, pod)
	n := csiCalls(mock, "NodePublishVolume") - published
	eph := mock.lines(`"Method":"/csi.v1.Node/NodePublishVolume"`, `"csi.storage.k8s.io/ephemeral":"true"`, `"Error":""`)
	t.Logf("pod %s with an inline %s volume ran %.1fs after it was created; the mock answered NodePublishVolume %d time(s)", name, mockCSI, time.Since(start).Seconds(), n)
	if n != 1 || eph < 1 {
		t.Errorf("NodePublishVolume answered %d times for the pod (%d marked ephemeral in all), want 1, ephemeral", n, eph)
	}
	deletePod(t, pod)
	waitUntil(t, time.Minute, "kubelet calls NodeUnpublishVolume", func(context.Context) (bool, string) {
		n := csiCalls(mock, "NodeUnpublishVolume") - unpublished
		return n >= 1, fmt.Sprintf("%d calls", n)
	})
}

// draExampleClaim applies dra-example-driver's DeviceClass (its chart's template) and the
// ResourceClaimTemplate of its demo spec gpu-test1.yaml (with the namespace), and runs a
// pod claiming a GPU from that template, as the demo's pods do: the claim controller makes
// the claim, the scheduler allocates it from the ResourceSlice the plugin published itself,
// kubelet has it prepared by the plugin multireg registered (the plugin's checkpoint lists
// the claim), the pod runs; deleting it unprepares the claim.
func draExampleClaim(t *testing.T, dra *hostPlugin) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	class, err := os.ReadFile(filepath.Join(*thirdparty, "deviceclass.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	demo, err := os.ReadFile(filepath.Join(*thirdparty, "gpu-test1.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	docs := []string{strings.Replace(string(class), `{{ include "dra-example-driver.resourceApiVersion" . }}`, "resource.k8s.io/v1", 1)}
	for _, d := range strings.Split(string(demo), "\n---\n") {
		if strings.Contains(d, "\nkind: Namespace\n") || strings.Contains(d, "\nkind: ResourceClaimTemplate\n") {
			docs = append(docs, d)
		}
	}
	if len(docs) != 3 {
		t.Fatalf("gpu-test1.yaml: want its Namespace and ResourceClaimTemplate, found %d of them", len(docs)-1)
	}
	spec := filepath.Join(tempDir(t), "dra-example.yaml")
	if err := os.WriteFile(spec, []byte(strings.Join(docs, "\n---\n")), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := cl.Kubectl(ctx, "apply", "-f", spec); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	t.Cleanup(func() {
		dctx, dcancel := context.WithTimeout(context.Background(), time.Minute)
		defer dcancel()
		if out, err := cl.Kubectl(dctx, "delete", "-f", spec, "--wait=false"); err != nil {
			t.Errorf("%v\n%s", err, out)
		}
	})
	waitUntil(t, time.Minute, "dra-example-kubeletplugin's own ResourceSlice for the node", func(ctx context.Context) (bool, string) {
		list, err := cl.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err.Error()
		}
		for _, s := range list.Items {
			if s.Spec.Driver == gpuDriver && s.Spec.NodeName != nil && *s.Spec.NodeName == cluster.NodeName && len(s.Spec.Devices) > 0 {
				return true, ""
			}
		}
		return false, fmt.Sprintf("%d slices, none of %s for %s", len(list.Items), gpuDriver, cluster.NodeName)
	})

	pod := pausePod("pod0", gpuDemoNS)
	tmpl := gpuDemoRCT
	pod.Spec.ResourceClaims = []corev1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: &tmpl}}
	pod.Spec.Containers[0].Resources.Claims = []corev1.ResourceClaim{{Name: "gpu"}}
	start := time.Now()
	p := runPod(t, pod)
	if len(p.Status.ResourceClaimStatuses) != 1 || p.Status.ResourceClaimStatuses[0].ResourceClaimName == nil {
		t.Fatalf("pod %s runs without a claim made from %s: %+v", pod.Name, gpuDemoRCT, p.Status.ResourceClaimStatuses)
	}
	claim, err := cl.Client.ResourceV1().ResourceClaims(gpuDemoNS).Get(ctx, *p.Status.ResourceClaimStatuses[0].ResourceClaimName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if claim.Status.Allocation == nil || len(claim.Status.Allocation.Devices.Results) != 1 || claim.Status.Allocation.Devices.Results[0].Driver != gpuDriver {
		t.Fatalf("claim %s not allocated a device of %s: %+v", claim.Name, gpuDriver, claim.Status.Allocation)
	}
	checkpoint := filepath.Join(cl.PluginsDir, gpuDriver, "checkpoint.json")
	if !preparedIn(t, checkpoint, string(claim.UID)) {
		t.Errorf("pod %s runs, but dra-example-kubeletplugin's checkpoint does not list claim %s as prepared", pod.Name, claim.Name)
	}
	t.Logf("pod %s/%s claiming %s (claim %s from template %s) ran %.1fs after it was created; prepared by dra-example-kubeletplugin",
		gpuDemoNS, pod.Name, claim.Status.Allocation.Devices.Results[0].Device, claim.Name, gpuDemoRCT, time.Since(start).Seconds())
	deletePod(t, pod)
	waitUntil(t, time.Minute, "kubelet has the claim unprepared once the pod is gone", func(context.Context) (bool, string) {
		return !preparedIn(t, checkpoint, string(claim.UID)), "still in the checkpoint"
	})
	if dra.Exited() {
		t.Errorf("dra-example-kubeletplugin exited: %v", dra.Err())
	}
}

// preparedIn reports whether dra-example-kubeletplugin's checkpoint lists the claim prepared.
func preparedIn(t *testing.T, checkpoint, uid string) bool {
	t.Helper()
	b, err := os.ReadFile(checkpoint)
	if err != nil {
		t.Fatal(err)
	}
	var cp struct {
		V1 struct {
			PreparedClaims map[string]json.RawMessage `json:"preparedClaims"`
		} `json:"v1"`
	}
	if err := json.Unmarshal(b, &cp); err != nil {
		t.Fatalf("%s: %v", checkpoint, err)
	}
	_, ok := cp.V1.PreparedClaims[uid]
	return ok
}

// sampleDevicePod runs a pod requesting one device of the sample device plugin: kubelet's
// device manager calls Allocate on the plugin multireg registered, the pod runs; capacity and
// allocatable stay at the plugin's 2 devices.
func sampleDevicePod(t *testing.T, dp *hostPlugin) {
	t.Helper()
	allocs := dp.lines(`"Allocate" request=`)
	pod := pausePod("e2e-sample-device", "default")
	one := corev1.ResourceList{corev1.ResourceName(sampleRes): resource.MustParse("1")}
	pod.Spec.Containers[0].Resources = corev1.ResourceRequirements{Limits: one, Requests: one}
	start := time.Now()
	runPod(t, pod)
	n := dp.lines(`"Allocate" request=`) - allocs
	t.Logf("pod requesting 1 %s ran %.1fs after it was created; the sample device plugin's Allocate called %d time(s)", sampleRes, time.Since(start).Seconds(), n)
	if n != 1 {
		t.Errorf("the sample device plugin logged %d Allocate calls for the pod, want 1", n)
	}
	if c, a, err := capacity(context.Background(), sampleRes); err != nil || c != nSample || a != nSample {
		t.Errorf("node %s: capacity %d, allocatable %d (%v), want %d", sampleRes, c, a, err, nSample)
	}
	deletePod(t, pod)
}

// csiMockRestart restarts the mock CSI driver under the same socket name: it answers
// NodeGetInfo as before (the same node ID), so multireg leaves the registration alone: a
// CSINode watch sees the driver never leave, kubelet does not call NodeGetInfo on the new
// process (multireg does, once), the registration socket and multireg's attempts do not
// change; and the next inline volume is published by the new process.
func csiMockRestart(t *testing.T, mr *hostMultireg, mock *hostPlugin, endpoint, dir string) {
	before := waitAllRegistered(t, mr, mockCSI)
	sock := idents(t, mockCSI)
	// Only once multireg has recorded the driver's answer can it compare the restart's.
	waitUntil(t, 30*time.Second, "multireg to record "+mockCSI+"'s NodeGetInfo", func(context.Context) (bool, string) {
		return logLines(mr.log, "NodeGetInfo recorded", mockCSI) > 0, "not in multireg's log"
	})
	w := watchCSINode(t)
	mock.stop(t)
	restarted := startCSIMock(t, endpoint, filepath.Join(dir, "csimock.2.log"))
	start := time.Now()
	waitUntil(t, 30*time.Second, "multireg to ask the restarted driver NodeGetInfo", func(context.Context) (bool, string) {
		n := csiCalls(restarted, "NodeGetInfo")
		return n >= 1, fmt.Sprintf("%d calls", n)
	})
	t.Logf("%s restarted: NodeGetInfo asked %.0fms after the new process listened", mockCSI, float64(time.Since(start).Milliseconds()))
	stays(t, 3*time.Second, "the registration of the restarted mock CSI driver is left alone", func(ctx context.Context) (string, error) {
		if n := csiCalls(restarted, "NodeGetInfo"); n != 1 {
			return fmt.Sprintf("NodeGetInfo answered %d times by the restarted driver: kubelet registered it again", n), nil
		}
		st, err := mr.status(ctx)
		if err != nil {
			return "", err
		}
		if st[mockCSI].Phase != "Registered" || st[mockCSI].Attempts != before[mockCSI].Attempts {
			return fmt.Sprintf("%s: %+v, before %+v", mockCSI, st[mockCSI], before[mockCSI]), nil
		}
		return "", nil
	})
	assertSame(t, "the restarted mock CSI driver's registration socket", sock, idents(t, mockCSI))
	gaps, err := w.stop()
	if err != nil {
		t.Fatal(err)
	}
	longest := time.Duration(0)
	for _, g := range gaps[mockCSI] {
		longest = max(longest, g)
	}
	t.Logf("mock CSI driver restart: missing from CSINode %d time(s), longest %dms", len(gaps[mockCSI]), longest.Milliseconds())
	figures = append(figures, fmt.Sprintf("mock CSI driver (k8s e2e csi-test) restart, same socket and node ID: longest time missing from CSINode: %dms (%d times)", longest.Milliseconds(), len(gaps[mockCSI])))
	if len(gaps[mockCSI]) != 0 {
		t.Errorf("%s left CSINode %d time(s) during its restart (%v): its registration was touched", mockCSI, len(gaps[mockCSI]), gaps[mockCSI])
	}
	inlineVolumePod(t, restarted, "e2e-inline-2")
}

// pausePod is a pod of one pause container. Its deletion is graceful (a grace period of 0
// would remove it from the API server before kubelet has stopped it): pause stops at once.
func pausePod(name, namespace string) *corev1.Pod {
	grace := int64(1)
	noToken := false
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace},
		Spec: corev1.PodSpec{
			AutomountServiceAccountToken:  &noToken,
			TerminationGracePeriodSeconds: &grace,
			Containers:                    []corev1.Container{{Name: "c", Image: pauseRef, ImagePullPolicy: corev1.PullIfNotPresent}},
		},
	}
}

// runPod creates the pod (retried while its namespace's service account is not there yet) and
// waits until it runs; the test deletes it at the end if it is still there.
func runPod(t *testing.T, pod *corev1.Pod) *corev1.Pod {
	t.Helper()
	pods := cl.Client.CoreV1().Pods(pod.Namespace)
	waitUntil(t, time.Minute, "pod "+pod.Name+" created", func(ctx context.Context) (bool, string) {
		_, err := pods.Create(ctx, pod, metav1.CreateOptions{})
		return err == nil, fmt.Sprint(err)
	})
	t.Cleanup(func() {
		if err := pods.Delete(context.Background(), pod.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("delete pod %s: %v", pod.Name, err)
		}
	})
	var p *corev1.Pod
	waitUntil(t, 2*time.Minute, "pod "+pod.Name+" runs", func(ctx context.Context) (bool, string) {
		var err error
		if p, err = pods.Get(ctx, pod.Name, metav1.GetOptions{}); err != nil {
			return false, err.Error()
		}
		return p.Status.Phase == corev1.PodRunning, podState(*p) + " " + fmt.Sprint(p.Status.Conditions)
	})
	return p
}

// deletePod deletes the pod and waits until it is gone.
func deletePod(t *testing.T, pod *corev1.Pod) {
	t.Helper()
	pods := cl.Client.CoreV1().Pods(pod.Namespace)
	if err := pods.Delete(context.Background(), pod.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 2*time.Minute, "pod "+pod.Name+" gone", func(ctx context.Context) (bool, string) {
		_, err := pods.Get(ctx, pod.Name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), fmt.Sprint(err)
	})
}
