package node_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/version"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
	podresources "k8s.io/kubelet/pkg/apis/podresources/v1"

	"multireg.dev/multireg/e2e/node/cluster"
	"multireg.dev/multireg/e2e/node/endpoints"
)

// Scenarios of what kubelet 1.37 changed (DRA device health, several endpoints per device
// plugin resource), run on every version the node is built with: each says what it expects of
// the version it finds.

// kubeletAtLeast reports whether the cluster's kubelet (built from one release with the API
// server) is at least 1.minor.
func kubeletAtLeast(t *testing.T, minor uint) bool {
	t.Helper()
	info, err := cl.Client.Discovery().ServerVersion()
	if err != nil {
		t.Fatal(err)
	}
	v, err := version.ParseGeneric(info.GitVersion)
	if err != nil {
		t.Fatalf("server version %q: %v", info.GitVersion, err)
	}
	return v.AtLeast(version.MajorMinor(1, minor))
}

// withEntry adds a driver entry to the drivers file until the test ends, then puts the file
// back as it was and waits until multireg no longer lists the driver.
func withEntry(t *testing.T, mr *hostMultireg, config, name, entry string) {
	t.Helper()
	orig, err := os.ReadFile(config)
	if err != nil {
		t.Fatal(err)
	}
	writeFileAtomic(t, config, string(orig)+entry)
	t.Cleanup(func() {
		writeFileAtomic(t, config, string(orig))
		waitUntil(t, time.Minute, name+" gone from multireg's drivers", func(ctx context.Context) (bool, string) {
			st, err := mr.status(ctx)
			if err != nil {
				return false, err.Error()
			}
			_, there := st[name]
			return !there, fmt.Sprint(st[name])
		})
	})
}

// podResourcesAllocatable counts the devices of resource that kubelet's device manager has as
// allocatable now (healthy, from a connected plugin), through the pod-resources API: unlike
// node status, which kubelet writes every few seconds, it is read live.
func podResourcesAllocatable(ctx context.Context, resource string) (int, error) {
	conn, err := grpc.NewClient("unix:"+filepath.Join(cl.KubeletRoot, "pod-resources", "kubelet.sock"),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return 0, err
	}
	defer conn.Close()
	resp, err := podresources.NewPodResourcesListerClient(conn).GetAllocatableResources(ctx, &podresources.AllocatableResourcesRequest{})
	if err != nil {
		return 0, err
	}
	n := 0
	for _, d := range resp.GetDevices() {
		if d.GetResourceName() == resource {
			n += len(d.GetDeviceIds())
		}
	}
	return n, nil
}

// allocatableWatch polls, until stopped, how many devices of a resource are allocatable: live
// from the pod-resources API every 50 ms, and in node status every 500 ms.
type allocatableWatch struct {
	cancel context.CancelFunc
	wg     sync.WaitGroup
	mu     sync.Mutex
	live   shortfall
	status shortfall
	looks  int
}

func watchAllocatable(t *testing.T, resource string, want int) *allocatableWatch {
	ctx, cancel := context.WithCancel(context.Background())
	w := &allocatableWatch{cancel: cancel}
	poll := func(every time.Duration, look func(context.Context) (int, error), s *shortfall) {
		defer w.wg.Done()
		tick := time.NewTicker(every)
		defer tick.Stop()
		for {
			n, err := look(ctx)
			if ctx.Err() != nil {
				return
			}
			if err == nil {
				w.mu.Lock()
				s.observe(n, want)
				w.looks++
				w.mu.Unlock()
			}
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
		}
	}
	w.wg.Add(2)
	go poll(50*time.Millisecond, func(ctx context.Context) (int, error) { return podResourcesAllocatable(ctx, resource) }, &w.live)
	go poll(500*time.Millisecond, func(ctx context.Context) (int, error) {
		_, a, err := capacity(ctx, resource)
		return int(a), err
	}, &w.status)
	t.Cleanup(func() { w.stop() })
	return w
}

// stop ends the watch and returns how long the resource was seen short, live and in node
// status (an absence still running counts until now).
func (w *allocatableWatch) stop() (live, status time.Duration, looks int) {
	w.cancel()
	w.wg.Wait()
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, s := range []*shortfall{&w.live, &w.status} {
		if !s.since.IsZero() {
			s.total += time.Since(s.since)
			s.since = time.Time{}
		}
	}
	return w.live.total, w.status.total, w.looks
}

// 4g. A device plugin's rolling update, twice: a new instance (dp.2, then dp.3, a new socket
// name) starts while the old one runs, then the old one exits; the resource's allocatable is
// read live from kubelet's pod-resources API every 50 ms. multireg registers the first new
// instance beside the old one and reads kubelet's view after the old one goes. On kubelet 1.37,
// which keeps several endpoints per resource, both moves go beside and the devices never leave
// allocatable. On older kubelets (one client per resource name), whatever gRPC they were built
// with, the first move's devices drop when the old instance goes: multireg registers the new
// instance again at once, and the second move goes in place of the old registration as soon as
// the new instance answers (kubelet deregisters the old socket and registers the new one in
// one reconcile pass), the old instance exiting after. Before one move a
// bystander calls GetInfo with a gRPC user agent that once decided the move (1.37: an older
// gRPC; older kubelets: gRPC 1.85): it changes nothing.
func scenarioDevicePluginRollingUpdate(t *testing.T, mr *hostMultireg, config string) {
	const res, n = "example.com/rolling", 2
	dir := endpointPath("rolling", "")
	start := func(name string) *endpoints.DevicePlugin {
		t.Helper()
		p, err := endpoints.StartDevicePlugin(filepath.Join(dir, name), endpoints.DeviceOptions{ResourceName: res, Devices: n})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Stop)
		return p
	}
	registeredAt := func(p *endpoints.DevicePlugin) driverStatus {
		t.Helper()
		var s driverStatus
		waitUntil(t, time.Minute, res+" registered at "+filepath.Base(p.Path())+", its devices allocatable", func(ctx context.Context) (bool, string) {
			st, err := mr.status(ctx)
			if err != nil {
				return false, err.Error()
			}
			s = st[res]
			live, err := podResourcesAllocatable(ctx, res)
			_, open := p.ListAndWatchStreams()
			return s.Phase == "Registered" && s.Endpoint == p.Path() && live == n && open == 1,
				fmt.Sprintf("%+v; allocatable %d (%v); streams open %d", s, live, err, open)
		})
		return s
	}
	keeps := kubeletAtLeast(t, 37)

	old := start("dp.1")
	withEntry(t, mr, config, res, driverEntry(res, "DevicePlugin", filepath.Join(dir, "dp.*")))
	first := registeredAt(old).Socket
	second := strings.TrimSuffix(first, ".sock") + ".1.sock"
	third := strings.TrimSuffix(first, ".sock") + ".2.sock" // a drop's repair while kubelet holds both others
	// The watch starts once node status has the new resource too: kubelet writes it a moment
	// after the registration, and that first moment is no shortfall of the update.
	waitUntil(t, time.Minute, "node status shows "+res, func(ctx context.Context) (bool, string) {
		_, a, err := capacity(ctx, res)
		return err == nil && a == n, fmt.Sprintf("allocatable %d (%v)", a, err)
	})

	bystanders := []string{"", "grpc-go/1.60.0"} // 1.37: the second move after an older gRPC's GetInfo
	if !keeps {
		bystanders = []string{"grpc-go/1.85.0", ""} // older: the first move after a newer gRPC's GetInfo
	}
	for i, name := range []string{"dp.2", "dp.3"} {
		cur, _ := mr.status(context.Background())
		if by := bystanders[i]; by != "" {
			registrationGetInfoAs(t, cur[res].Socket, by)
		}
		beside := keeps || i == 0
		watch := watchAllocatable(t, res, n)
		nw := start(name) // the rolling update's new instance
		if beside {
			registeredAt(nw)
			waitUntil(t, time.Minute, "kubelet holds both instances' registrations", func(ctx context.Context) (bool, string) {
				reg, err := kubeletRegistered(ctx)
				return err == nil && len(held(reg, first, second, third)) == 2, fmt.Sprint(reg, err)
			})
		} else {
			// In place of the old registration: the new instance's socket in the other path,
			// the old one's removed, while the old instance runs.
			s := registeredAt(nw)
			waitUntil(t, time.Minute, "kubelet holds the new instance's registration alone", func(ctx context.Context) (bool, string) {
				reg, err := kubeletRegistered(ctx)
				return err == nil && len(held(reg, first, second, third)) == 1 && reg[s.Socket], fmt.Sprint(reg, err)
			})
		}
		exited := time.Now()
		old.Stop() // the old instance exits
		s := registeredAt(nw)
		waitUntil(t, time.Minute, "one registration socket of "+res+" left in kubelet", func(ctx context.Context) (bool, string) {
			reg, err := kubeletRegistered(ctx)
			return err == nil && len(held(reg, first, second, third)) == 1 && reg[s.Socket], fmt.Sprint(reg, err)
		})
		waitUntil(t, time.Minute, "node status shows every device allocatable", func(ctx context.Context) (bool, string) {
			_, a, err := capacity(ctx, res)
			// Node status is written every 10 s: a shortfall shows there within 12 s of the exit.
			return err == nil && a == n && time.Since(exited) > 12*time.Second, fmt.Sprintf("allocatable %d (%v)", a, err)
		})
		live, status, looks := watch.stop()
		dropped := logLines(mr.log, "kubelet dropped the resource's devices", res)
		how := "in place of the old registration, the old instance exiting after"
		switch {
		case keeps:
			how = "registered beside the old one"
			if live > 0 || status > 0 {
				t.Errorf("kubelet 1.37, move %d: %s short of allocatable devices for %s live and %s in node status, want never", i+1, res, live.Round(time.Millisecond), status.Round(time.Millisecond))
			}
			if dropped != 0 {
				t.Errorf("kubelet 1.37: multireg saw the devices dropped %d times, want never", dropped)
			}
		case beside:
			how = "registered beside the old one, the drop seen in kubelet's view, registered again"
			if dropped != 1 {
				t.Errorf("move %d: multireg logged the drop of the devices %d times, want once", i+1, dropped)
			}
		}
		if !keeps && live > maxShortOlder {
			t.Errorf("move %d (%s): %s short of allocatable devices for %s live, want at most %s", i+1, how, res, live.Round(time.Millisecond), maxShortOlder)
		}
		with := "no bystander"
		if bystanders[i] != "" {
			with = "after a bystander's GetInfo as " + bystanders[i]
		}
		t.Logf("device plugin rolling update %d (dp.*, %s, %s): allocatable short for %s live (pod-resources, 50 ms), %s in node status (%d looks)",
			i+1, how, with, live.Round(time.Millisecond), status.Round(time.Millisecond), looks)
		figures = append(figures, fmt.Sprintf("device plugin rolling update %d, dp.*, %s, %s: allocatable short %s live (pod-resources every 50 ms), %s in node status",
			i+1, how, with, live.Round(time.Millisecond), status.Round(time.Millisecond)))
		old = nw
	}
}

// maxShortOlder bounds how long a device plugin's rolling update may leave its resource
// without devices on a kubelet that keeps one client per resource name. A move in place of the
// old registration costs nothing kubelet's view can see (0 ms measured): kubelet deregisters
// the old socket and registers the new one in one reconcile pass. The first move after a start
// is registered beside the old instance, whose exit drops the devices: multireg sees the drop
// (100 ms) and registers the new instance again in a third path, which kubelet registers in
// its next reconcile pass (0.90-0.96 s measured). The bound leaves room for a loaded machine. A resource
// stranded by a registration beside the old instance never comes back (until the plugin or
// kubelet restarts).
const maxShortOlder = 2 * time.Second

// registrationGetInfoAs calls GetInfo on a registration socket as a local client whose gRPC
// user agent starts with agent (a probe, grpcurl, another registrar), not as kubelet.
func registrationGetInfoAs(t *testing.T, socket, agent string) {
	t.Helper()
	conn, err := grpc.NewClient("unix:"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithUserAgent(agent))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := registerapi.NewRegistrationClient(conn).GetInfo(ctx, &registerapi.InfoRequest{}); err != nil {
		t.Fatalf("GetInfo on %s as %s: %v", socket, agent, err)
	}
}

// 4h. DRA device health (kubelet 1.36 watches every DRA driver's v1alpha1 health service;
// 1.37 only a driver whose registration lists it, the newest listed, and stops for good at
// Unimplemented): a DRA driver that serves v1alpha1.DRAResourceHealth only, and answers v1's
// NodeWatchResources Unimplemented a second late, registered by multireg with the default
// versions, has its device's health in the pod's allocatedResourcesStatus, Healthy and then
// Unhealthy when the driver says so. multireg found the v1alpha1 service on the endpoint, and
// only it, and advertised it: had it advertised v1, kubelet 1.37 would call v1 and stop.
func scenarioDRAHealth(t *testing.T, mr *hostMultireg, config string) {
	const driver, class, claimName, podName = "health.multireg.test", "e2e-health", "e2e-health", "e2e-health"
	node := cluster.NodeName
	dra, err := endpoints.StartDRA(endpointPath("health", "dra.sock"), endpoints.DRAOptions{
		DriverName: driver, Pool: node, Device: "dev-0", Health: true, V1HealthUnimplementedAfter: time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(dra.Stop)
	withEntry(t, mr, config, driver, driverEntry(driver, "DRAPlugin", dra.Path()))
	waitUntil(t, time.Minute, driver+" Registered", func(ctx context.Context) (bool, string) {
		st, err := mr.status(ctx)
		return err == nil && st[driver].Phase == "Registered", fmt.Sprint(st[driver], err)
	})
	if n := logLines(mr.log, "device health services the DRA driver serves, advertised to kubelet", driver, "v1alpha1.DRAResourceHealth"); n != 1 {
		t.Errorf("multireg logged the health service it advertises for %s %d times, want once", driver, n)
	}
	if n := logLines(mr.log, "device health services the DRA driver serves, advertised to kubelet", driver, "v1.DRAResourceHealth"); n != 0 {
		t.Errorf("multireg advertised v1.DRAResourceHealth for %s, which answers it Unimplemented (after a second)", driver)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	rc := cl.Client.ResourceV1()
	never, noToken, cn := int64(0), false, claimName
	create := func(what string, err error, del func() error) {
		t.Helper()
		if err != nil {
			t.Fatalf("create %s: %v", what, err)
		}
		t.Cleanup(func() {
			if err := del(); err != nil && !apierrors.IsNotFound(err) {
				t.Errorf("delete %s: %v", what, err)
			}
		})
	}
	_, err = rc.DeviceClasses().Create(ctx, &resourcev1.DeviceClass{
		ObjectMeta: metav1.ObjectMeta{Name: class},
		Spec: resourcev1.DeviceClassSpec{Selectors: []resourcev1.DeviceSelector{{
			CEL: &resourcev1.CELDeviceSelector{Expression: fmt.Sprintf("device.driver == %q", driver)},
		}}},
	}, metav1.CreateOptions{})
	create("DeviceClass", err, func() error { return rc.DeviceClasses().Delete(context.Background(), class, metav1.DeleteOptions{}) })
	_, err = rc.ResourceSlices().Create(ctx, &resourcev1.ResourceSlice{
		ObjectMeta: metav1.ObjectMeta{Name: "e2e-health-" + node},
		Spec: resourcev1.ResourceSliceSpec{
			Driver: driver, NodeName: &node,
			Pool:    resourcev1.ResourcePool{Name: node, Generation: 1, ResourceSliceCount: 1},
			Devices: []resourcev1.Device{{Name: "dev-0"}},
		},
	}, metav1.CreateOptions{})
	create("ResourceSlice", err, func() error {
		return rc.ResourceSlices().Delete(context.Background(), "e2e-health-"+node, metav1.DeleteOptions{})
	})
	_, err = rc.ResourceClaims("default").Create(ctx, &resourcev1.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: claimName},
		Spec: resourcev1.ResourceClaimSpec{Devices: resourcev1.DeviceClaim{Requests: []resourcev1.DeviceRequest{{
			Name: "dev", Exactly: &resourcev1.ExactDeviceRequest{DeviceClassName: class},
		}}}},
	}, metav1.CreateOptions{})
	create("ResourceClaim", err, func() error {
		return rc.ResourceClaims("default").Delete(context.Background(), claimName, metav1.DeleteOptions{})
	})
	pods := cl.Client.CoreV1().Pods("default")
	_, err = pods.Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: podName},
		Spec: corev1.PodSpec{
			ResourceClaims:                []corev1.PodResourceClaim{{Name: "d", ResourceClaimName: &cn}},
			AutomountServiceAccountToken:  &noToken,
			TerminationGracePeriodSeconds: &never,
			Containers: []corev1.Container{{
				Name: "c", Image: pauseRef, ImagePullPolicy: corev1.PullIfNotPresent,
				Resources: corev1.ResourceRequirements{Claims: []corev1.ResourceClaim{{Name: "d"}}},
			}},
		},
	}, metav1.CreateOptions{})
	create("Pod", err, func() error { return pods.Delete(context.Background(), podName, metav1.DeleteOptions{}) })

	health := func(ctx context.Context) (string, string) {
		p, err := pods.Get(ctx, podName, metav1.GetOptions{})
		if err != nil {
			return "", err.Error()
		}
		for _, cs := range p.Status.ContainerStatuses {
			for _, rs := range cs.AllocatedResourcesStatus {
				for _, r := range rs.Resources {
					return string(r.Health), fmt.Sprintf("%s: %+v", podState(*p), cs.AllocatedResourcesStatus)
				}
			}
		}
		return "", podState(*p) + ": no allocatedResourcesStatus"
	}
	if !kubeletAtLeast(t, 36) {
		waitUntil(t, 2*time.Minute, "the pod with a claim runs", func(ctx context.Context) (bool, string) {
			p, err := pods.Get(ctx, podName, metav1.GetOptions{})
			return err == nil && p.Status.Phase == corev1.PodRunning, fmt.Sprint(err)
		})
		t.Logf("kubelet before 1.36 watches no device health (ResourceHealthStatus is alpha): the claim was prepared; the health service listed changed nothing")
		return
	}
	waitUntil(t, 2*time.Minute, "the pod runs and reports its device Healthy", func(ctx context.Context) (bool, string) {
		h, why := health(ctx)
		return h == string(corev1.ResourceHealthStatusHealthy), why
	})
	dra.SetHealth(false)
	took := waitUntil(t, 2*time.Minute, "the pod reports its device Unhealthy", func(ctx context.Context) (bool, string) {
		h, why := health(ctx)
		return h == string(corev1.ResourceHealthStatusUnhealthy), why
	})
	t.Logf("DRA device health through multireg's registration: Healthy, then Unhealthy in the pod's allocatedResourcesStatus %s after the driver said so", took.Round(10*time.Millisecond))
	figures = append(figures, fmt.Sprintf("DRA device health (v1alpha1.DRAResourceHealth found on the endpoint and advertised, v1's Unimplemented a second late not): a device turned Unhealthy reached the pod's allocatedResourcesStatus in %s", took.Round(10*time.Millisecond)))
}

// 4i. A device plugin that registers itself on kubelet.sock, listed in the drivers file too (a
// mistake multireg must contain): the file is invalid. The reload that lists it is refused,
// saying why as multireg validate does, and the last good file stays; the plugin's own
// registration is untouched — it even registers again after a restart, which kubelet 1.37
// would refuse until its own restart had a second registration of the endpoint been refused
// once.
func scenarioSelfRegisteredDevicePlugin(t *testing.T, mr *hostMultireg, config string) {
	const res, n = "example.com/selfreg", 2
	path := filepath.Join(filepath.Dir(pluginapi.KubeletSocket), "e2e-selfreg.sock")
	startRegistered := func() *endpoints.DevicePlugin {
		t.Helper()
		p, err := endpoints.StartDevicePlugin(path, endpoints.DeviceOptions{ResourceName: res, Devices: n})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Stop)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := p.RegisterWithKubelet(ctx, pluginapi.KubeletSocket); err != nil {
			t.Fatal(err)
		}
		waitUntil(t, time.Minute, res+"'s devices allocatable through its own registration", func(ctx context.Context) (bool, string) {
			live, err := podResourcesAllocatable(ctx, res)
			_, open := p.ListAndWatchStreams()
			return live == n && open == 1, fmt.Sprintf("allocatable %d (%v), streams open %d", live, err, open)
		})
		return p
	}
	p := startRegistered()
	withEntry(t, mr, config, res, driverEntry(res, "DevicePlugin", path))
	// What multireg validate says of the file on this node, without the file's name.
	out, err := exec.Command(*multiregBin, "validate", "--config", config).CombinedOutput()
	want, _, _ := strings.Cut(strings.TrimPrefix(string(out), config+": "), "\n")
	if err == nil || !strings.Contains(want, `.endpoint: "`+path+`": is in kubelet's device-plugin directory`) {
		t.Fatalf("multireg validate: %v: %s, want the device plugin refused", err, out)
	}
	var lastErr string
	waitUntil(t, time.Minute, "multireg refuses the reload, as validate says", func(ctx context.Context) (bool, string) {
		ok, e, err := mr.reloadState(ctx)
		if err != nil {
			return false, err.Error()
		}
		lastErr = e
		return !ok && e == want, fmt.Sprintf("lastReloadSuccessful %v, lastReloadError %q", ok, e)
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	st, err := mr.status(ctx)
	cancel()
	if _, listed := st[res]; err != nil || listed {
		t.Errorf("multireg's drivers: %v (%v), want %s not among them", st, err, res)
	}
	if n := logLines(mr.log, "config not applied; the last good one stays in force", "kubelet's device-plugin directory"); n != 1 {
		t.Errorf("multireg logged the refusal %d times, want once", n)
	}
	if opened, _ := p.ListAndWatchStreams(); opened != 1 {
		t.Errorf("kubelet opened %d ListAndWatch streams on %s, want its own registration's one", opened, res)
	}

	// The plugin restarts and registers itself again: kubelet takes it (a second registration
	// refused earlier would have left the endpoint refused on 1.37).
	p.Stop()
	p = startRegistered()
	t.Logf("a self-registering device plugin listed in the drivers file: multireg refused the file (%q); the plugin's own registration held, and again after its restart", lastErr)
	figures = append(figures, "self-registering device plugin listed in the drivers file: the reload refused as multireg validate says, the last good file kept; the plugin's own registration kept, re-registered itself after a restart")
}
