package node_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"multireg.dev/multireg/e2e/internal/fileid"
	"multireg.dev/multireg/e2e/node/endpoints"
)

// The host scenarios' drivers: two CSI drivers, a device plugin with 3 devices and a DRA
// driver, each a real endpoint of its API that kubelet's own handler talks to.
const (
	csiA     = "alpha.csi.multireg.test"
	csiB     = "beta.csi.multireg.test"
	csiC     = "gamma.csi.multireg.test" // scenario 2: NodeGetInfo fails twice
	widget   = "example.com/widget"
	draName  = "dra.multireg.test"
	nWidgets = 3
)

type hostDrivers struct {
	a, b, c *endpoints.CSI
	dp      *endpoints.DevicePlugin
	dra     *endpoints.DRA
}

func endpointPath(dir, file string) string { return filepath.Join(cl.PluginsDir, dir, file) }

func hostConfig(drivers ...string) string {
	var b strings.Builder
	fmt.Fprintf(&b, `apiVersion: multireg.dev/v1alpha1
kind: RegistrarConfig
registrationDir: %s
defaults:
  backoff:
    initialInterval: 500ms
    maxInterval: 5s
drivers:
`, cl.PluginsRegistry)
	for _, d := range drivers {
		b.WriteString(d)
	}
	return b.String()
}

func driverEntry(name, typ, endpoint string, extra ...string) string {
	s := fmt.Sprintf("  - name: %s\n    type: %s\n    endpoint: %s\n", name, typ, endpoint)
	for _, e := range extra {
		s += "    " + e + "\n"
	}
	return s
}

var (
	entryA   = func() string { return driverEntry(csiA, "CSIPlugin", endpointPath("alpha", "csi.sock")) }
	entryB   = func() string { return driverEntry(csiB, "CSIPlugin", endpointPath("beta", "csi.sock")) }
	entryC   = func() string { return driverEntry(csiC, "CSIPlugin", endpointPath("gamma", "csi.sock")) }
	entryDP  = func() string { return driverEntry(widget, "DevicePlugin", endpointPath("widget", "dp.sock")) }
	entryDRA = func() string { return driverEntry(draName, "DRAPlugin", endpointPath("dra", "dra.sock")) }
)

// TestNode runs the scenarios in order on the one cluster: multireg on the host registering
// every kind of plugin (1), a rejection by kubelet's CSI handler (2), a kubelet restart (3), a
// driver removed and put back (4); then the shipped DaemonSet (5) and an upgrade to this build
// from a release without hand-overs (5b).
func TestNode(t *testing.T) {
	dir := tempDir(t)
	config := filepath.Join(dir, "config.yaml")
	var eps hostDrivers
	start := func(f func() error) {
		t.Helper()
		if err := f(); err != nil {
			t.Fatal(err)
		}
	}
	start(func() (err error) {
		eps.a, err = endpoints.StartCSI(endpointPath("alpha", "csi.sock"), endpoints.CSIOptions{Name: csiA, NodeID: "alpha-node-1"})
		return err
	})
	t.Cleanup(eps.a.Stop)
	start(func() (err error) {
		eps.b, err = endpoints.StartCSI(endpointPath("beta", "csi.sock"), endpoints.CSIOptions{Name: csiB, NodeID: "beta-node-1"})
		return err
	})
	t.Cleanup(eps.b.Stop)
	start(func() (err error) {
		eps.dp, err = endpoints.StartDevicePlugin(endpointPath("widget", "dp.sock"), endpoints.DeviceOptions{ResourceName: widget, Devices: nWidgets})
		return err
	})
	t.Cleanup(eps.dp.Stop)
	start(func() (err error) {
		eps.dra, err = endpoints.StartDRA(endpointPath("dra", "dra.sock"), endpoints.DRAOptions{DriverName: draName})
		return err
	})
	t.Cleanup(eps.dra.Stop)
	// Scenario 2's driver; its endpoint runs from the start, multireg learns of it there.
	start(func() (err error) {
		eps.c, err = endpoints.StartCSI(endpointPath("gamma", "csi.sock"), endpoints.CSIOptions{Name: csiC, NodeID: "gamma-node-1", FailNodeGetInfo: 2})
		return err
	})
	t.Cleanup(eps.c.Stop)

	writeFileAtomic(t, config, hostConfig(entryA(), entryB(), entryDP(), entryDRA()))
	// --cleanup-on-exit: the DaemonSet of scenario 5 starts from an empty registry.
	mrStart := time.Now()
	mr := startHostMultireg(t, config, "--cleanup-on-exit")

	ok := scenario(t, "1-csi-device-dra-registered", func(t *testing.T) { scenarioAll(t, mr, &eps, mrStart) }) &&
		scenario(t, "2-csi-nodegetinfo-fails-twice", func(t *testing.T) { scenarioRejected(t, mr, &eps, config) }) &&
		scenario(t, "3-kubelet-restart", func(t *testing.T) { scenarioKubeletRestart(t, mr, &eps) }) &&
		scenario(t, "4-remove-and-restore-a-driver", func(t *testing.T) { scenarioRemoveRestore(t, mr, &eps, config) }) &&
		scenario(t, "4b-csi-driver-restart", func(t *testing.T) { scenarioCSIRestart(t, mr, &eps) }) &&
		scenario(t, "4c-dra-driver-restart", func(t *testing.T) { scenarioDRARestart(t, mr, &eps) }) &&
		scenario(t, "4d-device-plugin-restart", func(t *testing.T) { scenarioDevicePluginRestart(t, mr, &eps) }) &&
		scenario(t, "4e-dra-rolling-update", func(t *testing.T) { scenarioDRARollingUpdate(t, mr, &eps, config) }) &&
		scenario(t, "4f-migrate-from-sidecar", func(t *testing.T) { scenarioMigrateFromSidecar(t, mr, config) }) &&
		scenario(t, "4g-device-plugin-rolling-update", func(t *testing.T) { scenarioDevicePluginRollingUpdate(t, mr, config) }) &&
		scenario(t, "4h-dra-device-health", func(t *testing.T) { scenarioDRAHealth(t, mr, config) }) &&
		scenario(t, "4i-self-registered-device-plugin", func(t *testing.T) { scenarioSelfRegisteredDevicePlugin(t, mr, config) })
	if !ok {
		return
	}
	// Hand the node over: multireg on the host removes its sockets, every driver leaves.
	mr.stop(t)
	waitUntil(t, 30*time.Second, "CSINode empty after the host multireg stopped", func(ctx context.Context) (bool, string) {
		drivers, err := csiNodeDrivers(ctx)
		if err != nil {
			return false, err.Error()
		}
		return len(drivers) == 0, fmt.Sprint(drivers)
	})
	env := newDSEnv(t)
	_ = scenario(t, "5-daemonset-as-shipped", func(t *testing.T) { scenarioDaemonSet(t, env) }) &&
		scenario(t, "5b-upgrade-from-a-release-without-hand-over", func(t *testing.T) { scenarioUpgradeFromRelease(t, env) })
}

// 1. Every kind of plugin registered by multireg reaches kubelet's real handler: CSINode
// lists both CSI drivers with the node IDs their NodeGetInfo returned, node capacity shows the
// 3 devices, kubelet's DRA manager connects to the DRA endpoint, and multireg reports each
// driver Registered: kubelet's own verdict, sent after its handler's RegisterPlugin succeeded.
func scenarioAll(t *testing.T, mr *hostMultireg, eps *hostDrivers, mrStart time.Time) {
	waitUntil(t, 60*time.Second, "both CSI drivers in CSINode with their node IDs", func(ctx context.Context) (bool, string) {
		drivers, err := csiNodeDrivers(ctx)
		if err != nil {
			return false, err.Error()
		}
		return drivers[csiA] == "alpha-node-1" && drivers[csiB] == "beta-node-1", fmt.Sprint(drivers)
	})
	t.Logf("CSINode lists %s and %s %.1fs after multireg started", csiA, csiB, time.Since(mrStart).Seconds())
	waitUntil(t, 60*time.Second, "node capacity "+widget, func(ctx context.Context) (bool, string) {
		c, a, err := capacity(ctx, widget)
		if err != nil {
			return false, err.Error()
		}
		return c == nWidgets && a == nWidgets, fmt.Sprintf("capacity %d, allocatable %d", c, a)
	})
	t.Logf("node.status shows %d %s %.1fs after multireg started", nWidgets, widget, time.Since(mrStart).Seconds())
	all := []string{csiA, csiB, widget, draName}
	waitAllRegistered(t, mr, all...)
	waitKubeletHolds(t, all...)
	// kubelet's DRA manager connects once RegisterPlugin returned, asynchronously.
	waitUntil(t, 30*time.Second, "kubelet's DRA manager connects to the DRA endpoint", func(context.Context) (bool, string) {
		return eps.dra.Connections() > 0, "no connection yet"
	})
	if opened, open := eps.dp.ListAndWatchStreams(); opened < 1 || open != 1 {
		t.Errorf("ListAndWatch streams: %d opened, %d open; want kubelet's one open stream", opened, open)
	}
	draClaimPod(t, eps.dra)
}

// waitKubeletHolds waits until kubelet's plugin manager holds every named driver's socket
// (plugin_manager_total_plugins{state="actual_state_of_world"}, from kubelet's metrics).
func waitKubeletHolds(t *testing.T, names ...string) {
	t.Helper()
	waitUntil(t, 30*time.Second, "kubelet's plugin manager holds every plugin", func(ctx context.Context) (bool, string) {
		reg, err := kubeletRegistered(ctx)
		if err != nil {
			return false, err.Error()
		}
		for _, n := range names {
			if !reg[socketOf(t, n)] {
				return false, fmt.Sprintf("%s not held; kubelet holds %v", n, reg)
			}
		}
		return true, ""
	})
}

// waitAllRegistered waits until multireg on the host reports every named driver Registered,
// notes their sockets, and returns the status.
func waitAllRegistered(t *testing.T, mr *hostMultireg, names ...string) map[string]driverStatus {
	t.Helper()
	return waitRegisteredAt(t, "multireg on the host", "http://"+mr.addr+"/status", names...)
}

// waitRegisteredAt waits until the multireg whose /status is url reports every named driver
// Registered, notes their sockets, and returns the status.
func waitRegisteredAt(t *testing.T, who, url string, names ...string) map[string]driverStatus {
	t.Helper()
	var st map[string]driverStatus
	waitUntil(t, 30*time.Second, who+" reports every driver Registered", func(ctx context.Context) (bool, string) {
		var err error
		if st, err = statusAt(ctx, url); err != nil {
			return false, err.Error()
		}
		for _, n := range names {
			if st[n].Phase != "Registered" {
				return false, fmt.Sprintf("%s: %+v", n, st[n])
			}
		}
		return true, ""
	})
	for _, n := range names {
		sockets[n] = st[n].Socket
	}
	return st
}

// 2. A CSI driver whose NodeGetInfo fails twice: kubelet's CSI handler rejects the
// registration, multireg reports kubelet's reason and retries by recreating its socket (since
// kubelet ≤ 1.35 would not retry by itself), and the driver ends up in CSINode.
func scenarioRejected(t *testing.T, mr *hostMultireg, eps *hostDrivers, config string) {
	others := []string{csiA, csiB, widget, draName}
	before := idents(t, others...)
	logFrom := kubeletLogSize(t)
	// A slow first retry keeps kubelet's verdict visible in /status for a while.
	writeFileAtomic(t, config, hostConfig(entryA(), entryB(), entryDP(), entryDRA(), entryCSlow()))
	var reason string
	waitUntil(t, 30*time.Second, "multireg's /status shows kubelet's rejection of "+csiC, func(ctx context.Context) (bool, string) {
		st, err := mr.status(ctx)
		if err != nil {
			return false, err.Error()
		}
		s := st[csiC]
		reason = s.LastError
		return s.Failures >= 1 && strings.Contains(s.LastError, "injected"), fmt.Sprintf("%+v", s)
	})
	t.Logf("multireg /status lastError of %s: %q", csiC, reason)
	start := time.Now()
	waitUntil(t, 60*time.Second, csiC+" in CSINode", func(ctx context.Context) (bool, string) {
		drivers, err := csiNodeDrivers(ctx)
		if err != nil {
			return false, err.Error()
		}
		return drivers[csiC] == "gamma-node-1", fmt.Sprint(drivers)
	})
	st := waitAllRegistered(t, mr, append(others, csiC)...)
	// kubelet 1.35 and older keep a plugin whose RegisterPlugin failed in their actual state
	// of the world, as if registered, and never try it again by themselves: only a removed
	// socket (an unregistration) and a new one get it registered. There each rejected socket
	// that multireg withdrew shows as one unregistration in kubelet's log; newer kubelets
	// take a rejected plugin out at once, and unregister nothing.
	unregs := 0
	for _, l := range pluginManagerEvents(t, logFrom, csiC)[csiC] {
		if strings.Contains(l, "OperationExecutor.UnregisterPlugin started") {
			unregs++
		}
	}
	t.Logf("kubelet %s unregistered %s %d time(s) while multireg withdrew its rejected sockets", cl.Version, csiC, unregs)
	if !cl.Version.AtLeast(1, 36) && unregs != 2 {
		t.Errorf("kubelet %s unregistered %s %d time(s); want 2: each rejected socket it kept, withdrawn by multireg", cl.Version, csiC, unregs)
	}
	okCalls, failed := eps.c.NodeGetInfoCalls()
	t.Logf("%s in CSINode %.1fs after its rejection was seen; NodeGetInfo: %d failed, %d ok; multireg: %d sockets published, %d failures",
		csiC, time.Since(start).Seconds(), failed, okCalls, st[csiC].Attempts, st[csiC].Failures)
	if failed != 2 || okCalls < 1 {
		t.Errorf("NodeGetInfo calls: %d failed, %d ok; want 2 failed then at least 1 ok", failed, okCalls)
	}
	// Each rejection made multireg publish a new socket: 3 in all, 2 recreated for "rejected".
	if st[csiC].Failures != 2 || st[csiC].Attempts != 3 {
		t.Errorf("multireg for %s: %d failures, %d sockets published; want kubelet's 2 rejections, each answered by a new socket (3)",
			csiC, st[csiC].Failures, st[csiC].Attempts)
	}
	text, err := mr.metrics(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if v, _ := metric(text, "multireg_socket_recreations_total", map[string]string{"driver": csiC, "reason": "rejected"}); v != 2 {
		t.Errorf("multireg_socket_recreations_total{driver=%q,reason=\"rejected\"} = %v, want 2", csiC, v)
	}
	assertSame(t, "sockets of the other drivers", before, idents(t, others...))
}

// 3. kubelet restarts: every registration comes back (seen at the endpoints, in the new
// kubelet's plugin manager, and as one more accepted registration per driver in multireg's
// metrics), and multireg is untouched: same process, same sockets, nothing published again.
func scenarioKubeletRestart(t *testing.T, mr *hostMultireg, eps *hostDrivers) {
	all := []string{csiA, csiB, csiC, widget, draName}
	before := waitAllRegistered(t, mr, all...)
	regsBefore, err := mr.registrations(context.Background(), all...)
	if err != nil {
		t.Fatal(err)
	}
	socks := idents(t, all...)
	pid := mr.PID()
	aOK, _ := eps.a.NodeGetInfoCalls()
	bOK, _ := eps.b.NodeGetInfoCalls()
	cOK, _ := eps.c.NodeGetInfoCalls()
	streams, _ := eps.dp.ListAndWatchStreams()
	conns := eps.dra.Connections()
	oldKubelet := cl.KubeletPID()

	if err := cl.StopKubelet(); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	startCtx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if err := cl.StartKubelet(startCtx); err != nil {
		t.Fatal(err)
	}
	t.Logf("kubelet restarted (pid %d → %d), node Ready after %.1fs", oldKubelet, cl.KubeletPID(), time.Since(start).Seconds())
	waitUntil(t, 60*time.Second, "the new kubelet registers every plugin again", func(ctx context.Context) (bool, string) {
		a, _ := eps.a.NodeGetInfoCalls()
		b, _ := eps.b.NodeGetInfoCalls()
		c, _ := eps.c.NodeGetInfoCalls()
		s, open := eps.dp.ListAndWatchStreams()
		switch {
		case a <= aOK || b <= bOK || c <= cOK:
			return false, "a CSI endpoint got no new NodeGetInfo"
		case s <= streams || open != 1:
			return false, fmt.Sprintf("device plugin: %d streams opened (before %d), %d open", s, streams, open)
		case eps.dra.Connections() <= conns:
			return false, "no new connection to the DRA endpoint"
		}
		// kubelet's verdict, sent after RegisterPlugin returned: one more accepted
		// registration per driver.
		regs, err := mr.registrations(ctx, all...)
		if err != nil {
			return false, err.Error()
		}
		for _, n := range all {
			if regs[n] != regsBefore[n]+1 {
				return false, fmt.Sprintf("%s: %d registrations accepted (before %d)", n, regs[n], regsBefore[n])
			}
		}
		return true, ""
	})
	t.Logf("every plugin registered with the new kubelet %.1fs after it started", time.Since(start).Seconds())
	waitKubeletHolds(t, all...)
	waitUntil(t, 60*time.Second, "node capacity "+widget+" after the restart", func(ctx context.Context) (bool, string) {
		c, a, err := capacity(ctx, widget)
		return err == nil && c == nWidgets && a == nWidgets, fmt.Sprintf("capacity %d allocatable %d %v", c, a, err)
	})
	// Untouched, over a few reconcile passes: exactly one new registration each, the same
	// sockets, no socket published again, no failure, the same process.
	stays(t, 2500*time.Millisecond, "multireg untouched by kubelet's restart", func(ctx context.Context) (string, error) {
		regs, err := mr.registrations(ctx, all...)
		if err != nil {
			return "", err
		}
		st, err := mr.status(ctx)
		if err != nil {
			return "", err
		}
		for _, n := range all {
			if regs[n] != regsBefore[n]+1 {
				return fmt.Sprintf("%s: %d registrations accepted, want %d", n, regs[n], regsBefore[n]+1), nil
			}
			if st[n].Phase != "Registered" || st[n].Attempts != before[n].Attempts || st[n].Failures != before[n].Failures {
				return fmt.Sprintf("%s: %+v, before %+v", n, st[n], before[n]), nil
			}
		}
		if mr.Exited() || mr.PID() != pid {
			return "multireg did not survive kubelet's restart", nil
		}
		return "", nil
	})
	assertSame(t, "registration sockets (multireg untouched)", socks, idents(t, all...))
	drivers, err := csiNodeDrivers(context.Background())
	if err != nil || drivers[csiA] == "" || drivers[csiB] == "" || drivers[csiC] == "" {
		t.Errorf("CSINode after the restart: %v %v", drivers, err)
	}
}

// 4. A CSI driver removed from the drivers file leaves CSINode; put back, it returns. Nothing
// else in CSINode, node capacity, the other sockets or the other endpoints moves, over a few
// reconcile passes after each change.
func scenarioRemoveRestore(t *testing.T, mr *hostMultireg, eps *hostDrivers, config string) {
	others := []string{csiA, csiC, widget, draName}
	before := waitAllRegistered(t, mr, append(others, csiB)...)
	socks := idents(t, others...)
	csinode, err := csiNodeDrivers(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	wantOthers := map[string]string{csiA: csinode[csiA], csiC: csinode[csiC]}
	aOK, _ := eps.a.NodeGetInfoCalls()
	cOK, _ := eps.c.NodeGetInfoCalls()
	streams, _ := eps.dp.ListAndWatchStreams()
	conns := eps.dra.Connections()
	unchanged := func(when string) {
		t.Helper()
		stays(t, 2500*time.Millisecond, "nothing else moves "+when, func(ctx context.Context) (string, error) {
			a, _ := eps.a.NodeGetInfoCalls()
			c, _ := eps.c.NodeGetInfoCalls()
			s, open := eps.dp.ListAndWatchStreams()
			if a != aOK || c != cOK || s != streams || open != 1 || eps.dra.Connections() != conns {
				return fmt.Sprintf("another driver was registered again: NodeGetInfo %s %d→%d, %s %d→%d; ListAndWatch %d→%d (%d open); DRA connections %d→%d",
					csiA, aOK, a, csiC, cOK, c, streams, s, open, conns, eps.dra.Connections()), nil
			}
			capC, capA, err := capacity(ctx, widget)
			if err != nil {
				return "", err
			}
			if capC != nWidgets || capA != nWidgets {
				return fmt.Sprintf("capacity %d allocatable %d, want %d", capC, capA, nWidgets), nil
			}
			drivers, err := csiNodeDrivers(ctx)
			if err != nil {
				return "", err
			}
			for n, id := range wantOthers {
				if drivers[n] != id {
					return fmt.Sprintf("CSINode %s: node ID %q, want %q", n, drivers[n], id), nil
				}
			}
			st, err := mr.status(ctx)
			if err != nil {
				return "", err
			}
			for _, n := range others {
				if st[n].Phase != "Registered" || st[n].Attempts != before[n].Attempts {
					return fmt.Sprintf("%s: %+v, before %+v", n, st[n], before[n]), nil
				}
			}
			return "", nil
		})
		assertSame(t, "other drivers' sockets "+when, socks, idents(t, others...))
	}

	bSocket := socketOf(t, csiB)
	start := time.Now()
	writeFileAtomic(t, config, hostConfig(entryA(), entryDP(), entryDRA(), entryCSlow()))
	waitUntil(t, 30*time.Second, csiB+" leaves CSINode", func(ctx context.Context) (bool, string) {
		drivers, err := csiNodeDrivers(ctx)
		if err != nil {
			return false, err.Error()
		}
		_, in := drivers[csiB]
		return !in, fmt.Sprint(drivers)
	})
	t.Logf("%s left CSINode %.1fs after the edit", csiB, time.Since(start).Seconds())
	if _, err := os.Lstat(bSocket); !os.IsNotExist(err) {
		t.Errorf("%s's socket still there after its removal: %v", csiB, err)
	}
	unchanged("after the removal")

	start = time.Now()
	writeFileAtomic(t, config, hostConfig(entryA(), entryB(), entryDP(), entryDRA(), entryCSlow()))
	waitUntil(t, 30*time.Second, csiB+" back in CSINode", func(ctx context.Context) (bool, string) {
		drivers, err := csiNodeDrivers(ctx)
		if err != nil {
			return false, err.Error()
		}
		return drivers[csiB] == "beta-node-1", fmt.Sprint(drivers)
	})
	t.Logf("%s back in CSINode %.1fs after the edit", csiB, time.Since(start).Seconds())
	unchanged("after the restore")
}

// 4b. A CSI driver restarts (its endpoint socket is created anew) and answers NodeGetInfo as
// before: multireg asks it itself and leaves the registration alone, so CSINode never loses
// the driver (a watch measures it) and kubelet does not call NodeGetInfo on the new process.
func scenarioCSIRestart(t *testing.T, mr *hostMultireg, eps *hostDrivers) {
	before := waitAllRegistered(t, mr, csiA)
	sock := idents(t, csiA)
	w := watchCSINode(t)
	path := eps.a.Path()
	eps.a.Stop()
	restarted, err := endpoints.StartCSI(path, endpoints.CSIOptions{Name: csiA, NodeID: "alpha-node-1"})
	if err != nil {
		t.Fatal(err)
	}
	eps.a = restarted
	t.Cleanup(restarted.Stop)
	start := time.Now()
	// multireg's own NodeGetInfo on the new process is the one call it gets.
	waitUntil(t, 30*time.Second, "multireg to ask the restarted driver NodeGetInfo", func(context.Context) (bool, string) {
		ok, _ := restarted.NodeGetInfoCalls()
		return ok >= 1, fmt.Sprintf("%d calls", ok)
	})
	t.Logf("%s restarted: multireg asked NodeGetInfo %.0fms after the new process listened", csiA, float64(time.Since(start).Milliseconds()))
	stays(t, 3*time.Second, "the registration of the restarted driver is left alone", func(ctx context.Context) (string, error) {
		if ok, _ := restarted.NodeGetInfoCalls(); ok != 1 {
			return fmt.Sprintf("NodeGetInfo called %d times on the restarted driver: kubelet registered it again", ok), nil
		}
		st, err := mr.status(ctx)
		if err != nil {
			return "", err
		}
		if st[csiA].Phase != "Registered" || st[csiA].Attempts != before[csiA].Attempts {
			return fmt.Sprintf("%s: %+v, before %+v", csiA, st[csiA], before[csiA]), nil
		}
		return "", nil
	})
	assertSame(t, "the restarted driver's registration socket", sock, idents(t, csiA))
	gaps, err := w.stop()
	if err != nil {
		t.Fatal(err)
	}
	longest := time.Duration(0)
	for _, g := range gaps[csiA] {
		longest = max(longest, g)
	}
	t.Logf("CSI driver restart: %s missing from CSINode %d time(s), longest %s", csiA, len(gaps[csiA]), longest.Round(time.Millisecond))
	figures = append(figures, fmt.Sprintf("CSI driver restart, same NodeGetInfo: longest time it was missing from CSINode: %s (%d times)", longest.Round(time.Millisecond), len(gaps[csiA])))
	if len(gaps[csiA]) != 0 {
		t.Errorf("%s left CSINode %d time(s) during its restart (%v): its registration was touched", csiA, len(gaps[csiA]), gaps[csiA])
	}
}

// 4c. A DRA driver restarts (its DRA service socket is created anew): multireg leaves its
// registration alone, kubelet's plugin manager holds it throughout, and kubelet's DRA
// manager reconnects to the new process by itself: a pod claiming a device runs, prepared by
// the new process.
func scenarioDRARestart(t *testing.T, mr *hostMultireg, eps *hostDrivers) {
	before := waitAllRegistered(t, mr, draName)
	sock := idents(t, draName)
	path := eps.dra.Path()
	eps.dra.Stop()
	restarted, err := endpoints.StartDRA(path, endpoints.DRAOptions{DriverName: draName})
	if err != nil {
		t.Fatal(err)
	}
	eps.dra = restarted
	t.Cleanup(restarted.Stop)
	start := time.Now()
	var reconnected time.Duration // when kubelet's first connection to the new process was seen
	stays(t, 3*time.Second, "the DRA driver's registration is left alone", func(ctx context.Context) (string, error) {
		if reconnected == 0 && restarted.Connections() > 0 {
			reconnected = time.Since(start)
		}
		reg, err := kubeletRegistered(ctx)
		if err != nil {
			return "", err
		}
		if !reg[socketOf(t, draName)] {
			return "kubelet's plugin manager no longer holds the DRA driver's socket", nil
		}
		st, err := mr.status(ctx)
		if err != nil {
			return "", err
		}
		if st[draName].Attempts != before[draName].Attempts {
			return fmt.Sprintf("%s: %+v, before %+v", draName, st[draName], before[draName]), nil
		}
		return "", nil
	})
	assertSame(t, "the restarted DRA driver's registration socket", sock, idents(t, draName))
	waitUntil(t, 2*time.Minute, "kubelet's DRA manager reconnects to the restarted driver", func(context.Context) (bool, string) {
		if reconnected == 0 && restarted.Connections() > 0 {
			reconnected = time.Since(start)
		}
		return reconnected > 0, "no connection yet"
	})
	t.Logf("DRA driver restart: kubelet reconnected to the new process within %s after it listened, without a new registration", reconnected.Round(10*time.Millisecond))
	figures = append(figures, fmt.Sprintf("DRA driver restart: kubelet reconnected by itself within %s; its plugin manager held the registration throughout", reconnected.Round(10*time.Millisecond)))
	draClaimPod(t, restarted)
}

// 4d. A device plugin restarts: kubelet's device manager needs a new registration (it stops
// the plugin when its ListAndWatch stream ends), so multireg registers it again on a new
// socket. How long the node's allocatable devices are short is measured from the API server.
func scenarioDevicePluginRestart(t *testing.T, mr *hostMultireg, eps *hostDrivers) {
	before := waitAllRegistered(t, mr, widget)
	sock := idents(t, widget)
	path := eps.dp.Path()
	eps.dp.Stop()
	restarted, err := endpoints.StartDevicePlugin(path, endpoints.DeviceOptions{ResourceName: widget, Devices: nWidgets})
	if err != nil {
		t.Fatal(err)
	}
	eps.dp = restarted
	t.Cleanup(restarted.Stop)
	start := time.Now()
	var short shortfall // of allocatable devices
	waitUntil(t, time.Minute, "a new ListAndWatch stream and every device allocatable again", func(ctx context.Context) (bool, string) {
		_, a, err := capacity(ctx, widget)
		if err != nil {
			return false, err.Error()
		}
		short.observe(int(a), nWidgets)
		opened, open := restarted.ListAndWatchStreams()
		return opened >= 1 && open == 1 && a == nWidgets && time.Since(start) > 3*time.Second, fmt.Sprintf("allocatable %d, streams %d opened %d open", a, opened, open)
	})
	if st := waitAllRegistered(t, mr, widget); st[widget].Attempts != before[widget].Attempts+1 {
		t.Errorf("%s: %d sockets published after its restart, want %d (one more)", widget, st[widget].Attempts, before[widget].Attempts+1)
	}
	if same := idents(t, widget); same[widget] == sock[widget] {
		t.Errorf("%s's registration socket was not published anew", widget)
	}
	t.Logf("device plugin restart: registered again; allocatable seen short of %d for %s", nWidgets, short.total.Round(time.Millisecond))
	figures = append(figures, fmt.Sprintf("device plugin restart: re-registered; allocatable seen short for %s, longest %dms (node status, polled)", short.total.Round(time.Millisecond), short.longest.Milliseconds()))
}

// entryCSlow is scenario 2's driver with a slow first retry.
func entryCSlow() string {
	return entryC() + "    backoff:\n      initialInterval: 2s\n      maxInterval: 4s\n"
}

func idents(t *testing.T, names ...string) map[string]fileid.ID {
	t.Helper()
	m := map[string]fileid.ID{}
	for _, n := range names {
		m[n] = fileid.Of(socketOf(t, n))
	}
	return m
}

func assertSame(t *testing.T, what string, before, after map[string]fileid.ID) {
	t.Helper()
	for n, id := range before {
		if id == (fileid.ID{}) {
			t.Errorf("%s: %s had no socket", what, n)
		} else if after[n] != id {
			t.Errorf("%s: %s's socket changed (%+v → %+v)", what, n, id, after[n])
		}
	}
}
