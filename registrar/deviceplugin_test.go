package registrar

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/podres"
	"multireg.dev/multireg/internal/testkit"
)

// devicePluginMove is a device plugin registered at dp.1 whose new instance, dp.2, starts.
type devicePluginMove struct {
	t       *testing.T
	s       *Supervisor
	d       config.Driver
	old     *servedEndpoint
	kubelet *testkit.PodResources // nil: no pod-resources API
	view    *podres.View
	first   fsid.ID // dp.1's registration socket
}

// startDevicePluginMove registers a device plugin at dp.1 with a supervisor of opts; with
// podResources, kubelet's pod-resources API is served and holds two of its devices.
func startDevicePluginMove(t *testing.T, opts Options, podResources bool) *devicePluginMove {
	dir := testkit.ShortDir(t)
	m := &devicePluginMove{t: t, d: patternDriver(dir, config.DevicePlugin, "dp.*")}
	if !m.d.RollsOver() || m.d.AltSocketPath == "" {
		t.Fatalf("a device plugin pattern without its second socket: %+v", m.d)
	}
	if podResources {
		sock := filepath.Join(dir, "pr.sock")
		m.kubelet = testkit.StartPodResources(t, sock)
		m.kubelet.Set(m.d.Name, 2)
		opts.PodResources = podres.New(sock, testkit.Logger(t))
		m.view = opts.PodResources
	}
	m.old = startInstance(t, m.d, "dp.1")
	ageFile(t, filepath.Join(filepath.Dir(m.d.LocalEndpoint), "dp.1"), time.Minute)
	m.s = runSupervisor(t, opts)
	if podResources {
		testkit.Eventually(t, 5*time.Second, "kubelet's view read", opts.PodResources.Available)
	}
	m.s.Start(m.d)
	awaitSocket(t, m.d)
	register(t, m.d.SocketPath, true, "")
	testkit.Eventually(t, 5*time.Second, "Registered", func() bool { return statusOf(m.s, m.d.Name).Phase == Registered })
	m.first = mustID(t, m.d.SocketPath)
	return m
}

// instance is the path of the driver's endpoint instance name.
func (m *devicePluginMove) instance(name string) string {
	return filepath.Join(filepath.Dir(m.d.LocalEndpoint), name)
}

// awaitBeside waits for the new instance's registration socket beside dp.1's, registers it
// as kubelet would, and checks that dp.1's stays while dp.1 runs.
func (m *devicePluginMove) awaitBeside(newSock, newInstance string) {
	t := m.t
	testkit.Eventually(t, 5*time.Second, "the second registration socket", func() bool { return testkit.IsSocket(newSock) })
	if info := register(t, newSock, true, ""); info.Endpoint != m.instance(newInstance) {
		t.Errorf("the second socket's endpoint %q, want %q", info.Endpoint, m.instance(newInstance))
	}
}

// awaitSwap waits for the registration of instance in another of the driver's paths than from,
// the socket in from (the one kubelet holds) removed, registers it as kubelet would, and
// returns its path: kubelet deregisters the one and registers the other in the same reconcile
// pass.
func (m *devicePluginMove) awaitSwap(from, instance string) string {
	t := m.t
	var to string
	testkit.Eventually(t, 5*time.Second, "a registration socket in another path than "+filepath.Base(from)+", none left there", func() bool {
		to = m.onlySocket()
		return to != "" && to != from
	})
	if info := register(t, to, true, ""); info.Endpoint != m.instance(instance) {
		t.Errorf("GetInfo's endpoint %q, want %q", info.Endpoint, m.instance(instance))
	}
	return to
}

// onlySocket is the one of the driver's registration paths where a socket is, "" when there
// is none or more than one.
func (m *devicePluginMove) onlySocket() string {
	var at []string
	for _, p := range m.d.SocketPaths() {
		if testkit.IsSocket(p) {
			at = append(at, p)
		}
	}
	if len(at) != 1 {
		return ""
	}
	return at[0]
}

// awaitAfter waits for a move registered in place of the old registration (awaitSwap) while
// the old instance runs, then stops the old instance: its exit changes nothing. It returns the
// registration's path.
func (m *devicePluginMove) awaitAfter(from, instance string, old *servedEndpoint) string {
	to := m.awaitSwap(from, instance)
	id := mustID(m.t, to)
	old.Stop()
	testkit.Never(m.t, time.Second, "a registration again once the old instance exited", func() bool {
		nid, _, err := fsid.Stat(to)
		return err != nil || nid != id || m.onlySocket() != to
	})
	return to
}

// TestDevicePluginMoveKept: with kubelet's pod-resources API at hand, a device plugin's new
// instance (dp.2) is registered beside the running one (dp.1) through the second socket, and
// dp.1's registration is withdrawn once dp.1 is gone. kubelet keeps the resource's devices (as
// 1.37 does): nothing is registered again, and the next move goes beside again.
func TestDevicePluginMoveKept(t *testing.T) {
	m := startDevicePluginMove(t, Options{}, true)
	startInstance(t, m.d, "dp.2")
	m.awaitBeside(m.d.AltSocketPath, "dp.2")
	testkit.Never(t, 500*time.Millisecond, "the old registration withdrawn while dp.1 runs", func() bool {
		id, _, err := fsid.Stat(m.d.SocketPath)
		return err != nil || id != m.first
	})
	alt := mustID(t, m.d.AltSocketPath)
	m.old.Stop()
	testkit.Eventually(t, 5*time.Second, "the old registration withdrawn once dp.1 is gone", func() bool {
		return !testkit.IsSocket(m.d.SocketPath)
	})
	calls := m.kubelet.Calls()
	testkit.Never(t, verifyFor+500*time.Millisecond, "dp.2 registered again", func() bool {
		id, _, err := fsid.Stat(m.d.AltSocketPath)
		return err != nil || id != alt
	})
	if n := m.kubelet.Calls() - calls; n < 10 {
		t.Errorf("kubelet's view read %d times while the move was verified, want quick reads", n)
	}
	if st := statusOf(m.s, m.d.Name); st.Phase != Registered || st.Endpoint != m.instance("dp.2") || st.Attempts != 2 || st.Recreations[ReasonDevicesDropped] != 0 {
		t.Errorf("status: %+v, want Registered at dp.2 after 2 attempts", st)
	}
	// The next move goes beside dp.2 again.
	startInstance(t, m.d, "dp.3")
	m.awaitBeside(m.d.SocketPath, "dp.3")
}

// TestDevicePluginMoveDropped: kubelet drops the resource's devices once dp.1's registration
// is withdrawn (as 1.36 and older do, which keep one client per resource name): multireg
// registers dp.2 again at once, and registers later new instances only after the old one is
// gone.
func TestDevicePluginMoveDropped(t *testing.T) {
	var log testkit.Buffer
	m := startDevicePluginMove(t, Options{Log: log.Logger()}, true)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("multireg's log:\n%s", log.String())
		}
	})
	dp2 := startInstance(t, m.d, "dp.2")
	m.awaitBeside(m.d.AltSocketPath, "dp.2")
	m.old.Stop()
	testkit.Eventually(t, 5*time.Second, "the old registration withdrawn once dp.1 is gone", func() bool {
		return !testkit.IsSocket(m.d.SocketPath)
	})
	m.kubelet.Set(m.d.Name, 0) // kubelet deregistered dp.1's socket, and with it the resource's client
	// dp.2 is registered again in the path kubelet does not hold: not dp.1's, withdrawn a
	// moment ago (kubelet may deregister it only in its next pass), but the third one.
	at := m.awaitSwap(m.d.AltSocketPath, "dp.2")
	if at != m.d.SparePath {
		t.Errorf("dp.2 registered again in %s, want the third path %s", at, m.d.SparePath)
	}
	m.kubelet.Set(m.d.Name, 2)
	testkit.Eventually(t, 5*time.Second, "Registered", func() bool { return statusOf(m.s, m.d.Name).Phase == Registered })
	if st := statusOf(m.s, m.d.Name); st.Recreations[ReasonDevicesDropped] != 1 {
		t.Errorf("recreations: %v, want one for %s", st.Recreations, ReasonDevicesDropped)
	}
	// Learnt once the registration that repaired the drop brought the devices back.
	for _, want := range []string{"kubelet dropped the resource's devices", "kubelet's device manager keeps one client per resource"} {
		testkit.Eventually(t, 5*time.Second, "the log saying "+want, func() bool { return strings.Contains(log.String(), want) })
	}
	// A read of kubelet's API that kubelet refuses (its rate limit) is no restart of kubelet:
	// what was learnt holds.
	calls := m.kubelet.Calls()
	m.kubelet.FailNext(status.Error(codes.ResourceExhausted, "rejected by rate limit"))
	m.view.Quick(time.Second)
	testkit.Eventually(t, 5*time.Second, "a refused read, and one answered", func() bool { return m.kubelet.Calls()-calls >= 2 })
	// From now on the new instance is registered in place of the old registration, in another
	// path, as soon as it answers.
	startInstance(t, m.d, "dp.3")
	at = m.awaitAfter(at, "dp.3", dp2)
	testkit.Eventually(t, 5*time.Second, "Registered at dp.3, kubelet's view showing its devices", func() bool {
		st := statusOf(m.s, m.d.Name)
		return st.Phase == Registered && st.Endpoint == m.instance("dp.3") && st.Kubelet != nil && st.Kubelet.Devices == 2
	})
	// That move is verified too: a drop registers dp.3 again, once.
	m.kubelet.Set(m.d.Name, 0)
	at = m.awaitSwap(at, "dp.3")
	testkit.Never(t, verifyFor+500*time.Millisecond, "the repair of a drop registered again", func() bool {
		return m.onlySocket() != at
	})
	if st := statusOf(m.s, m.d.Name); st.Recreations[ReasonDevicesDropped] != 2 {
		t.Errorf("recreations: %v, want two for %s", st.Recreations, ReasonDevicesDropped)
	}
	m.kubelet.Set(m.d.Name, 2)

	// Until kubelet restarts (maybe upgraded): its API goes and comes back, and the waiting
	// new instance is registered beside the running one again.
	sock := m.kubelet.Path()
	m.kubelet.Stop()
	testkit.Eventually(t, 5*time.Second, "kubelet's view down", func() bool { return !m.view.Available() })
	m.kubelet = testkit.StartPodResources(t, sock)
	m.kubelet.Set(m.d.Name, 2)
	testkit.Eventually(t, 5*time.Second, "kubelet's view back", m.view.Available)
	startInstance(t, m.d, "dp.4")
	var beside string
	testkit.Eventually(t, 5*time.Second, "a second registration socket beside "+filepath.Base(at), func() bool {
		for _, p := range m.d.SocketPaths() {
			if p != at && testkit.IsSocket(p) {
				beside = p
				return testkit.IsSocket(at)
			}
		}
		return false
	})
	m.awaitBeside(beside, "dp.4")
}

// TestDevicePluginMoveWithoutKubeletsView: without kubelet's pod-resources API, nothing tells
// what kubelet does with a move: the new instance is registered in place of the old one's
// registration, which every kubelet accepts.
func TestDevicePluginMoveWithoutKubeletsView(t *testing.T) {
	m := startDevicePluginMove(t, Options{}, false)
	startInstance(t, m.d, "dp.2")
	m.awaitAfter(m.d.SocketPath, "dp.2", m.old)
}

// TestDevicePluginMovesForced: --device-plugin-moves forces either way, whatever kubelet's
// view says or whether there is one.
func TestDevicePluginMovesForced(t *testing.T) {
	t.Run("beside", func(t *testing.T) {
		m := startDevicePluginMove(t, Options{DeviceMoves: config.MovesBeside}, false)
		startInstance(t, m.d, "dp.2")
		m.awaitBeside(m.d.AltSocketPath, "dp.2")
	})
	t.Run("after", func(t *testing.T) {
		m := startDevicePluginMove(t, Options{DeviceMoves: config.MovesAfter}, true)
		startInstance(t, m.d, "dp.2")
		m.awaitAfter(m.d.SocketPath, "dp.2", m.old)
	})
}

// TestForeignGetInfoChangesNothing: GetInfo calls by other local clients, whatever their gRPC
// release, change nothing of how a device plugin moves.
func TestForeignGetInfoChangesNothing(t *testing.T) {
	m := startDevicePluginMove(t, Options{}, false)
	for _, agent := range []string{"grpc-go/1.85.0", "grpc-go/1.60.0", kubelet137} {
		testkit.DialKubelet(t, m.d.SocketPath, agent).GetInfo(t)
	}
	startInstance(t, m.d, "dp.2")
	m.awaitAfter(m.d.SocketPath, "dp.2", m.old)
}

// TestKubeletViewOfDevicePlugin: a device plugin's status and metrics show what kubelet's
// pod-resources API says of its resource; a registered one whose resource kubelet holds no
// device of for longer than a reconcile pass is flagged and logged, once, and again when it
// is over.
func TestKubeletViewOfDevicePlugin(t *testing.T) {
	dir := testkit.ShortDir(t)
	d := testDriver(dir, "example.com/fpga", config.DevicePlugin, filepath.Join(dir, "ep", "fpga.sock"))
	startEndpoint(t, d.LocalEndpoint, "")
	sock := filepath.Join(dir, "pr.sock")
	k := testkit.StartPodResources(t, sock)
	k.Set(d.Name, 3)
	var log testkit.Buffer
	view := podres.New(sock, log.Logger())
	s := runSupervisor(t, Options{Log: log.Logger(), PodResources: view})
	s.Start(d)
	awaitSocket(t, d)
	registerAndWait(t, s, d)
	testkit.Eventually(t, 5*time.Second, "kubelet's view in the status", func() bool {
		kv := statusOf(s, d.Name).Kubelet
		return kv != nil && kv.Devices == 3 && !kv.Missing && !kv.ReadAt.IsZero()
	})
	reg := prometheus.NewRegistry()
	reg.MustRegister(NewCollector(s))
	metric := func(name string) (float64, bool) {
		fams, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range fams {
			if f.GetName() == name {
				return f.GetMetric()[0].GetGauge().GetValue(), true
			}
		}
		return 0, false
	}
	if v, ok := metric("multireg_kubelet_devices"); !ok || v != 3 {
		t.Errorf("multireg_kubelet_devices = %v (%v), want 3", v, ok)
	}
	if v, ok := metric("multireg_kubelet_pod_resources_up"); !ok || v != 1 {
		t.Errorf("multireg_kubelet_pod_resources_up = %v (%v), want 1", v, ok)
	}

	k.Set(d.Name, 0)
	testkit.Eventually(t, 5*time.Second, "the missing devices flagged", func() bool {
		kv := statusOf(s, d.Name).Kubelet
		return kv != nil && kv.Missing && kv.ReadAt.Sub(kv.Since) > podres.Period
	})
	if v, _ := metric("multireg_kubelet_devices_missing"); v != 1 {
		t.Errorf("multireg_kubelet_devices_missing = %v, want 1", v)
	}
	testkit.Eventually(t, 5*time.Second, "the warning logged", func() bool {
		return strings.Contains(log.String(), "kubelet holds no device of the registered device plugin's resource")
	})
	k.Set(d.Name, 3)
	testkit.Eventually(t, 5*time.Second, "the end logged", func() bool {
		return strings.Contains(log.String(), "kubelet holds the device plugin's devices again")
	})
	if n := strings.Count(log.String(), "kubelet holds no device of the registered"); n != 1 {
		t.Errorf("the warning logged %d times, want once", n)
	}
	if st := statusOf(s, d.Name); st.Kubelet.Missing || st.Phase != Registered {
		t.Errorf("status: %+v, want Registered and nothing missing", st)
	}
}

// TestKubeletViewPluginWithoutDevices: a device plugin that never had a device in kubelet (it
// runs on a node without its hardware) is not flagged.
func TestKubeletViewPluginWithoutDevices(t *testing.T) {
	dir := testkit.ShortDir(t)
	d := testDriver(dir, "example.com/fpga", config.DevicePlugin, filepath.Join(dir, "ep", "fpga.sock"))
	startEndpoint(t, d.LocalEndpoint, "")
	sock := filepath.Join(dir, "pr.sock")
	testkit.StartPodResources(t, sock)
	s := runSupervisor(t, Options{PodResources: podres.New(sock, nil)})
	s.Start(d)
	awaitSocket(t, d)
	registerAndWait(t, s, d)
	testkit.Eventually(t, 5*time.Second, "a pass of kubelet's view after the registration", func() bool {
		st := statusOf(s, d.Name)
		return st.Kubelet != nil && st.Kubelet.ReadAt.Sub(st.Since) > 2*podres.Period
	})
	if kv := statusOf(s, d.Name).Kubelet; kv.Missing || kv.Devices != 0 {
		t.Errorf("kubelet's view: %+v, want no device and nothing missing", kv)
	}
}

// TestKubeletViewNotForOtherTypes: only a device plugin has a resource in kubelet's view.
func TestKubeletViewNotForOtherTypes(t *testing.T) {
	dir := testkit.ShortDir(t)
	d := testDriver(dir, "nfs.csi.k8s.io", config.CSIPlugin, filepath.Join(dir, "ep", "csi.sock"))
	startEndpoint(t, d.LocalEndpoint, d.Name)
	sock := filepath.Join(dir, "pr.sock")
	testkit.StartPodResources(t, sock)
	view := podres.New(sock, nil)
	s := runSupervisor(t, Options{PodResources: view})
	s.Start(d)
	awaitSocket(t, d)
	registerAndWait(t, s, d)
	testkit.Eventually(t, 5*time.Second, "kubelet read", view.Available)
	if kv := statusOf(s, d.Name).Kubelet; kv != nil {
		t.Errorf("a CSI driver's kubelet view: %+v, want none", kv)
	}
}

// TestVerifyTimerDecidesARecentDrop: a drop seen too recently to decide is looked at again
// when it can be, though kubelet's view reads the same meanwhile (and no change wakes the
// wait), not only at the end of the verification.
func TestVerifyTimerDecidesARecentDrop(t *testing.T) {
	now := time.Now()
	w := &waiting{}
	m := &moveCheck{v: &verification{had: 2, until: now.Add(time.Hour), decideAt: now.Add(20 * time.Millisecond)}}
	defer func() { w.verifyEnd.Stop() }()
	select {
	case <-m.timer(w):
	case <-time.After(10 * time.Second):
		t.Fatal("the wait looks again only at the end of the verification, an hour away")
	}
	m.v.decideAt = time.Time{}
	m.v.until = time.Now().Add(20 * time.Millisecond)
	select {
	case <-m.timer(w):
	case <-time.After(10 * time.Second):
		t.Fatal("the end of the verification does not wake the wait")
	}
}

// TestSpareInTheWay: when kubelet drops a moved device plugin's devices, the repair goes to
// the third registration path, kubelet holding neither other; something else there (a file,
// or another process's listening socket, which kubelet would dial for 10 s) is left alone, and
// the repair goes to a path it can have: dp.1's, which kubelet lets go of within a pass. The
// status says what is in the way.
func TestSpareInTheWay(t *testing.T) {
	for _, what := range []string{"file", "listener"} {
		t.Run(what, func(t *testing.T) {
			var log testkit.Buffer
			m := startDevicePluginMove(t, Options{Log: log.Logger()}, true)
			t.Cleanup(func() {
				if t.Failed() {
					t.Logf("multireg's log:\n%s", log.String())
				}
			})
			switch what {
			case "file":
				if err := os.WriteFile(m.d.SparePath, []byte("not ours"), 0o600); err != nil {
					t.Fatal(err)
				}
			case "listener":
				silentListener(t, m.d.SparePath)
			}
			theirs := mustID(t, m.d.SparePath)
			startInstance(t, m.d, "dp.2")
			m.awaitBeside(m.d.AltSocketPath, "dp.2")
			m.old.Stop()
			testkit.Eventually(t, 5*time.Second, "the old registration withdrawn once dp.1 is gone", func() bool {
				return !testkit.IsSocket(m.d.SocketPath)
			})
			m.kubelet.Set(m.d.Name, 0) // kubelet dropped the resource with dp.1's registration
			testkit.Eventually(t, 5*time.Second, "dp.2 published again in dp.1's path", func() bool {
				return testkit.IsSocket(m.d.SocketPath) && !testkit.IsSocket(m.d.AltSocketPath)
			})
			if info := register(t, m.d.SocketPath, true, ""); info.Endpoint != m.instance("dp.2") {
				t.Errorf("GetInfo's endpoint %q, want dp.2", info.Endpoint)
			}
			testkit.Eventually(t, 5*time.Second, "Registered", func() bool { return statusOf(m.s, m.d.Name).Phase == Registered })
			st := statusOf(m.s, m.d.Name)
			if !slices.Contains(st.InTheWay, m.d.SparePath) || st.Results[ResultPublishFailed] != 0 {
				t.Errorf("status %+v, want the third path in the way, no publication failed", st)
			}
			if id := mustID(t, m.d.SparePath); id != theirs {
				t.Errorf("what was in the third path was replaced")
			}
		})
	}
}

// TestDevicePluginMoveUnhealthyIsNoDrop: the new instance reports its devices unhealthy, or
// none yet, when the old one goes, so kubelet's allocatable view (healthy devices only) shows
// none: that is no drop, nothing is registered again and nothing is learnt; the devices come
// back when the instance reports them healthy, and the next move goes beside again.
func TestDevicePluginMoveUnhealthyIsNoDrop(t *testing.T) {
	for _, how := range []string{"unhealthy", "late"} {
		t.Run(how, func(t *testing.T) {
			var log testkit.Buffer
			m := startDevicePluginMove(t, Options{Log: log.Logger()}, true)
			t.Cleanup(func() {
				if t.Failed() {
					t.Logf("multireg's log:\n%s", log.String())
				}
			})
			dp2 := testkit.StartDevicePlugin(t, m.instance("dp.2"), 0)
			if how == "unhealthy" {
				dp2.SetDevices(0, 2)
			}
			m.awaitBeside(m.d.AltSocketPath, "dp.2")
			alt := mustID(t, m.d.AltSocketPath)
			m.old.Stop()
			testkit.Eventually(t, 5*time.Second, "the old registration withdrawn once dp.1 is gone", func() bool {
				return !testkit.IsSocket(m.d.SocketPath)
			})
			m.kubelet.Set(m.d.Name, 0) // kubelet counts healthy devices only
			testkit.Eventually(t, 5*time.Second, "the verification's conclusion", func() bool {
				return strings.Contains(log.String(), "not a drop")
			})
			testkit.Never(t, verifyFor, "dp.2 registered again", func() bool {
				id, _, err := fsid.Stat(m.d.AltSocketPath)
				return err != nil || id != alt
			})
			dp2.SetDevices(2, 0)
			m.kubelet.Set(m.d.Name, 2)
			st := statusOf(m.s, m.d.Name)
			if st.Recreations[ReasonDevicesDropped] != 0 || strings.Contains(log.String(), "keeps one client per resource") {
				t.Errorf("recreations %v and the log learnt from devices the instance reported %s", st.Recreations, how)
			}
			// The next move goes beside again: nothing was learnt.
			startInstance(t, m.d, "dp.3")
			testkit.Eventually(t, 5*time.Second, "dp.3 registered beside dp.2", func() bool {
				return testkit.IsSocket(m.d.AltSocketPath) && testkit.IsSocket(m.d.SocketPath)
			})
		})
	}
}

// TestDevicePluginMovesWithoutKubeletsView: kubelet's pod-resources API configured but not
// answering is said once, by the view, and at the instance's level (PodResources: not
// answering, moves in place); each move goes in place of the old registration without a
// warning of its own that it was not verified.
func TestDevicePluginMovesWithoutKubeletsView(t *testing.T) {
	var log testkit.Buffer
	dir := testkit.ShortDir(t)
	view := podres.New(filepath.Join(dir, "none", "kubelet.sock"), log.Logger())
	m := startDevicePluginMove(t, Options{Log: log.Logger(), PodResources: view}, false)
	testkit.Eventually(t, 5*time.Second, "the view's absence logged", func() bool { return strings.Contains(log.String(), "does not answer") })
	if p, ok := m.s.PodResources(); !ok || p.Answers || p.DevicePluginMoves != "in place" {
		t.Errorf("PodResources() = %+v, %v; want not answering, moves in place", p, ok)
	}
	from := m.d.SocketPath
	for _, name := range []string{"dp.2", "dp.3"} {
		startInstance(t, m.d, name)
		from = m.awaitSwap(from, name)
		testkit.Eventually(t, 5*time.Second, name+" Registered", func() bool {
			st := statusOf(m.s, m.d.Name)
			return st.Phase == Registered && st.Endpoint == m.instance(name)
		})
	}
	testkit.Never(t, verifyFor+500*time.Millisecond, "a warning that a move was not verified (the view's absence is said once)", func() bool {
		return strings.Contains(log.String(), "the move was not verified")
	})
	if n := strings.Count(log.String(), "pod-resources API does not answer"); n != 1 {
		t.Errorf("the view's absence said %d times, want once", n)
	}
}

// TestDevicePluginMoveDropCountsFromTheWithdrawal: kubelet's view shows the resource without
// devices from the moment the old instance dies, through its registration, before multireg
// withdraws it. A drop is decided from the withdrawal on (droppedFor after it), not from the
// older reading: on a real node, kubelet took the new instance's devices within that time, and
// the older zero had made multireg register the new instance again at once.
func TestDevicePluginMoveDropCountsFromTheWithdrawal(t *testing.T) {
	var log testkit.Buffer
	m := startDevicePluginMove(t, Options{Log: log.Logger()}, true)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("multireg's log:\n%s", log.String())
		}
	})
	startInstance(t, m.d, "dp.2")
	m.awaitBeside(m.d.AltSocketPath, "dp.2")
	testkit.Eventually(t, 5*time.Second, "kubelet's view read with dp.1's devices", func() bool {
		st := statusOf(m.s, m.d.Name)
		return st.Kubelet != nil && st.Kubelet.Devices == 2
	})
	m.kubelet.Set(m.d.Name, 0) // dp.1 dies: kubelet holds none of its devices any more
	testkit.Eventually(t, 5*time.Second, "kubelet's view read without devices", func() bool {
		st := statusOf(m.s, m.d.Name)
		return st.Kubelet != nil && st.Kubelet.Devices == 0
	})
	testkit.Never(t, 3*droppedFor, "a drop decided while the old registration stays", func() bool {
		return strings.Contains(log.String(), "kubelet dropped the resource's devices")
	})
	m.old.Stop()
	// kubelet never takes dp.2's devices here: the drop is decided, droppedFor after the
	// withdrawal at the earliest.
	var withdrawn, dropped time.Time
	testkit.Eventually(t, 5*time.Second, "the withdrawal and the drop in the log", func() bool {
		withdrawn = logTime(t, log.String(), "withdrawing the old registration")
		dropped = logTime(t, log.String(), "kubelet dropped the resource's devices")
		return !withdrawn.IsZero() && !dropped.IsZero()
	})
	if d := dropped.Sub(withdrawn); d < droppedFor {
		t.Errorf("the drop decided %s after the withdrawal, want %s at least", d, droppedFor)
	}
}

// logTime is the time of the first line of logs (slog's text format) whose message holds msg;
// zero when there is none.
func logTime(t *testing.T, logs, msg string) time.Time {
	t.Helper()
	for line := range strings.Lines(logs) {
		if _, m, ok := strings.Cut(line, ` msg="`); !ok || !strings.Contains(strings.SplitN(m, `"`, 2)[0], msg) {
			continue
		}
		ts, _, _ := strings.Cut(strings.TrimPrefix(line, "time="), " ")
		at, err := time.Parse(time.RFC3339Nano, ts)
		if err != nil {
			t.Fatalf("the time of %q: %v", line, err)
		}
		return at
	}
	return time.Time{}
}
