package registrar

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	csi "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/handover"
	"multireg.dev/multireg/internal/probe"
	"multireg.dev/multireg/internal/sockfile"
	"multireg.dev/multireg/internal/testkit"
)

// transitionLine is step's debug line: one transition of a loop.
var transitionLine = regexp.MustCompile(`msg=transition .*?from=(\w+) event=(\w+) to=(\w+)`)

// transitionsIn returns the transitions a log holds, in order, each as From_Event_To.
func transitionsIn(log string) []string {
	var ts []string
	for _, m := range transitionLine.FindAllStringSubmatch(log, -1) {
		ts = append(ts, m[1]+"_"+m[2]+"_"+m[3])
	}
	return ts
}

// awaitTransition waits until the log holds the transition name (From_Event_To).
func awaitTransition(t testing.TB, log *testkit.Buffer, name string) {
	t.Helper()
	awaitTransitions(t, log, name, 1)
}

// countOf counts name in names.
func countOf(names []string, name string) int {
	n := 0
	for _, m := range names {
		if m == name {
			n++
		}
	}
	return n
}

// awaitTransitions waits until the log holds the transition name (From_Event_To) n times.
func awaitTransitions(t testing.TB, log *testkit.Buffer, name string, n int) {
	t.Helper()
	testkit.Eventually(t, 10*time.Second, fmt.Sprintf("the transition %s, %d times", name, n), func() bool {
		return countOf(transitionsIn(log.String()), name) >= n
	})
}

// rowNames are the transitions of r as tests name them (From_Event_To), one per destination;
// a row of any state names none of its own.
func (r row) rowNames() []string {
	if r.from == anyState {
		return nil
	}
	var names []string
	for _, d := range r.to {
		names = append(names, fmt.Sprintf("%s_%s_%s", r.from, r.on, d.to))
	}
	return names
}

// inTable reports whether the transition name (From_Event_To) is a row of the table.
func inTable(name string) bool {
	parts := strings.Split(name, "_")
	if len(parts) != 3 {
		return false
	}
	from, on, to := stateNamed(parts[0]), eventNamed(parts[1]), stateNamed(parts[2])
	if from == numStates || on == numEvents || to == numStates {
		return false
	}
	r := table[from][on]
	return r != nil && r.leadsTo(from, to)
}

// stateNamed is the state of that name; numStates for none.
func stateNamed(name string) state {
	i := slices.Index(stateNames[:], name)
	if i < 0 {
		return numStates
	}
	return state(i)
}

// eventNamed is the event of that name; numEvents for none.
func eventNamed(name string) eventKind {
	i := slices.Index(eventNames[:], name)
	if i < 0 {
		return numEvents
	}
	return eventKind(i)
}

// transitionTests exercise each transition of the table on the real loop, with real sockets
// and files, kubelet played over real gRPC: each is named after the transition it makes
// happen (From_Event_To), waits for the loop to log it, and checks what it does. A row of any
// state is exercised from the states named.
var transitionTests = []struct {
	name string
	run  func(t *testing.T, log *testkit.Buffer, name string)
}{
	{"WaitingForEndpoint_EndpointUp_Publishing", func(t *testing.T, log *testkit.Buffer, name string) {
		s, d, _ := setupOpts(t, config.CSIPlugin, false, Options{Log: log.Logger()}, nil)
		testkit.Eventually(t, 5*time.Second, "WaitingForEndpoint", func() bool { return statusOf(s, d.Name).Phase == WaitingForEndpoint })
		startEndpoint(t, d.LocalEndpoint, d.Name)
		awaitTransition(t, log, name)
		awaitSocket(t, d)
	}},
	{"WaitingForEndpoint_EndpointUp_Registered", func(t *testing.T, log *testkit.Buffer, name string) {
		// A rollover's new instance is rejected and goes: once the backoff is over, the
		// previous registration's instance is the one to register, and kubelet holds it.
		d := patternDriver(testkit.ShortDir(t), config.DRAPlugin, "dra-*.sock")
		// The backoff outlasts the test's steps between the rejection and dra-b's going.
		d.Backoff = config.Backoff{InitialInterval: 3 * time.Second, MaxInterval: 3 * time.Second, Multiplier: 2}
		a := startInstance(t, d, "dra-a.sock")
		ageFile(t, a.Path(), time.Minute)
		s := runSupervisor(t, Options{Log: log.Logger()})
		s.Start(d)
		awaitSocket(t, d)
		registerAndWait(t, s, d)
		first := mustID(t, d.SocketPath)
		b := startInstance(t, d, "dra-b.sock")
		testkit.Eventually(t, 5*time.Second, "the second registration socket", func() bool { return testkit.IsSocket(d.AltSocketPath) })
		register(t, d.AltSocketPath, false, "no")
		// Taken before dra-b goes: a look at the pattern first would withdraw dra-b's socket
		// with its verdict pending (AwaitingVerdict_EndpointMoved_FallingBack).
		awaitTransition(t, log, "AwaitingVerdict_Rejected_BackingOff")
		b.Stop()
		awaitTransition(t, log, name)
		if testkit.IsSocket(d.AltSocketPath) || mustID(t, d.SocketPath) != first {
			t.Error("a socket was published for the registration kubelet holds")
		}
		if st := statusOf(s, d.Name); st.Phase != Registered || st.Socket != d.SocketPath || st.Endpoint != a.Path() {
			t.Errorf("status %+v, want Registered on the first socket, at dra-a", st)
		}
	}},
	{"WaitingForEndpoint_EndpointRenamed_WaitingForEndpoint", func(t *testing.T, log *testkit.Buffer, name string) {
		// A CSI driver without a Node service: nothing recorded to keep its registration by, so
		// its restart registers it again, and it comes back under another name.
		s, d, e := setupOpts(t, config.CSIPlugin, true, Options{Log: log.Logger()}, nil)
		awaitSocket(t, d)
		registerAndWait(t, s, d)
		crash(t, s, d, e)
		startEndpoint(t, d.LocalEndpoint, "other.csi.k8s.io")
		awaitTransition(t, log, "Registered_EndpointRestarted_WaitingForEndpoint")
		awaitTransition(t, log, name)
		if testkit.IsSocket(d.SocketPath) {
			t.Error("the registration of a driver that reports another name is still there")
		}
	}},
	{"TakingOver_EndpointUp_Registered", func(t *testing.T, log *testkit.Buffer, name string) {
		reg, ds, a, before := registeredMultireg(t)
		b := startMultiregLog(t, reg, ds, log.Logger())
		a.handedOver(t)
		awaitTransition(t, log, name)
		for _, d := range ds {
			testkit.Eventually(t, 5*time.Second, d.Name+" Registered", func() bool { return statusOf(b.sup, d.Name).Phase == Registered })
		}
		if now := ids(t, ds); !slices.Equal(now, before) {
			t.Errorf("sockets replaced: %v, were %v", now, before)
		}
	}},
	{"TakingOver_EndpointUp_AwaitingVerdict", func(t *testing.T, log *testkit.Buffer, name string) {
		reg, ds, a := oneDriverMultireg(t)
		d := ds[0]
		dialKubelet(t, d.SocketPath).GetInfo(t) // kubelet registers the plugin meanwhile
		b := startMultiregLog(t, reg, ds, log.Logger())
		a.handedOver(t)
		awaitTransition(t, log, name)
		if st := statusOf(b.sup, d.Name); st.Phase != Serving {
			t.Errorf("phase %s, want Serving", st.Phase)
		}
		dialKubelet(t, d.SocketPath).Notify(t, true, "")
		awaitTransition(t, log, "AwaitingVerdict_Accepted_Registered")
	}},
	{"TakingOver_EndpointUp_Publishing", func(t *testing.T, log *testkit.Buffer, name string) {
		// The other instance probed another endpoint socket than the one there now: the device
		// plugin restarted during the hand-over, and kubelet needs a new registration.
		dir := testkit.ShortDir(t)
		d := handoverDrivers(t, dir)[1] // the device plugin
		id, f := handedSocket(t, d)
		s := runSupervisor(t, Options{Log: log.Logger()})
		s.TakeOver(handedWith(d, id, f, true, id)) // an endpoint identity that is not the endpoint's
		s.Start(d)
		awaitTransition(t, log, name)
		testkit.Eventually(t, 5*time.Second, "a new registration socket", func() bool {
			now, _, err := fsid.Stat(d.SocketPath)
			return err == nil && now != id
		})
		if st := statusOf(s, d.Name); st.Recreations[ReasonEndpointRestarted] != 1 {
			t.Errorf("recreations %v, want one for %s", st.Recreations, ReasonEndpointRestarted)
		}
	}},
	{"TakingOver_EndpointRenamed_WaitingForEndpoint", func(t *testing.T, log *testkit.Buffer, name string) {
		dir := testkit.ShortDir(t)
		d := testDriver(dir, "nfs.csi.k8s.io", config.CSIPlugin, filepath.Join(dir, "ep", "csi.sock"))
		startEndpoint(t, d.LocalEndpoint, "other.csi.k8s.io")
		id, f := handedSocket(t, d)
		s := runSupervisor(t, Options{Log: log.Logger()})
		s.TakeOver(handedWith(d, id, f, true, fsid.ID{}))
		s.Start(d)
		awaitTransition(t, log, name)
		testkit.Eventually(t, 5*time.Second, "the handed socket withdrawn", func() bool { return !testkit.IsSocket(d.SocketPath) })
	}},
	{"Restarting_EndpointUp_Registered", func(t *testing.T, log *testkit.Buffer, name string) {
		s, d, e := registeredCSINode(t, log, "node-a")
		first := mustID(t, d.SocketPath)
		crash(t, s, d, e)
		startCSINode(t, d.LocalEndpoint, d.Name, "node-a")
		awaitTransition(t, log, "Registered_EndpointRestarted_Restarting")
		awaitTransition(t, log, name)
		if id := mustID(t, d.SocketPath); id != first {
			t.Error("the registration socket was replaced")
		}
	}},
	{"Restarting_EndpointUp_Publishing", func(t *testing.T, log *testkit.Buffer, name string) {
		s, d, e := registeredCSINode(t, log, "node-a")
		first := mustID(t, d.SocketPath)
		crash(t, s, d, e)
		startCSINode(t, d.LocalEndpoint, d.Name, "node-b")
		awaitTransition(t, log, name)
		testkit.Eventually(t, 5*time.Second, "a new registration socket", func() bool {
			id, _, err := fsid.Stat(d.SocketPath)
			return err == nil && id != first
		})
	}},
	{"Restarting_EndpointRenamed_WaitingForEndpoint", func(t *testing.T, log *testkit.Buffer, name string) {
		s, d, e := registeredCSINode(t, log, "node-a")
		crash(t, s, d, e)
		startCSINode(t, d.LocalEndpoint, "other.csi.k8s.io", "node-a")
		awaitTransition(t, log, name)
		testkit.Eventually(t, 5*time.Second, "the registration withdrawn", func() bool { return !testkit.IsSocket(d.SocketPath) })
		if st := statusOf(s, d.Name); st.Recreations[ReasonEndpointRestarted] != 1 {
			t.Errorf("recreations %v, want the restart counted", st.Recreations)
		}
	}},
	{"FallingBack_EndpointUp_Registered", func(t *testing.T, log *testkit.Buffer, name string) {
		s, d, a, b := rolledOver(t, Options{Log: log.Logger()})
		first := mustID(t, d.SocketPath)
		b.Stop()
		awaitTransition(t, log, "Registered_EndpointMoved_FallingBack")
		awaitTransition(t, log, name)
		testkit.Eventually(t, 5*time.Second, "the new instance's registration withdrawn", func() bool { return !testkit.IsSocket(d.AltSocketPath) })
		if st := statusOf(s, d.Name); st.Phase != Registered || st.Socket != d.SocketPath || st.Endpoint != a.Path() || mustID(t, d.SocketPath) != first {
			t.Errorf("status %+v, want Registered on the first socket, untouched, at dra-a", st)
		}
	}},
	{"FallingBack_EndpointUp_Publishing", fallBackToANewerInstance},
	{"Publishing_PathFree_AwaitingVerdict", func(t *testing.T, log *testkit.Buffer, name string) {
		s, d, _ := setupOpts(t, config.DevicePlugin, true, Options{Log: log.Logger()}, nil)
		awaitTransition(t, log, name)
		awaitSocket(t, d)
		if st := statusOf(s, d.Name); st.Phase != Serving || st.Attempts != 1 {
			t.Errorf("status %+v, want Serving after 1 attempt", st)
		}
	}},
	{"Publishing_PathFree_BackingOff", func(t *testing.T, log *testkit.Buffer, name string) {
		s, d, _ := setupOpts(t, config.DevicePlugin, true, Options{Log: log.Logger()}, func(d *config.Driver) {
			if err := os.MkdirAll(d.SocketPath, 0o755); err != nil { // not a socket: never touched
				t.Fatal(err)
			}
		})
		awaitTransition(t, log, name)
		testkit.Eventually(t, 5*time.Second, "BackingOff, publish_failed counted", func() bool {
			st := statusOf(s, d.Name)
			return st.Phase == BackingOff && st.Results[ResultPublishFailed] >= 1
		})
	}},
	{"AwaitingVerdict_Accepted_Registered", func(t *testing.T, log *testkit.Buffer, name string) {
		s, d, _ := setupOpts(t, config.CSIPlugin, true, Options{Log: log.Logger()}, nil)
		awaitSocket(t, d)
		register(t, d.SocketPath, true, "")
		awaitTransition(t, log, name)
		if st := statusOf(s, d.Name); st.Phase != Registered || st.Results[ResultRegistered] != 1 {
			t.Errorf("status %+v, want Registered once", st)
		}
	}},
	{"AwaitingVerdict_Rejected_BackingOff", func(t *testing.T, log *testkit.Buffer, name string) {
		s, d, _ := setupOpts(t, config.CSIPlugin, true, Options{Log: log.Logger()}, slowBackoff)
		awaitSocket(t, d)
		register(t, d.SocketPath, false, "boom")
		awaitTransition(t, log, name)
		if st := statusOf(s, d.Name); st.Phase != BackingOff || !strings.Contains(st.LastError, "boom") || testkit.IsSocket(d.SocketPath) {
			t.Errorf("status %+v, socket there %v; want BackingOff with kubelet's error, the socket removed", st, testkit.IsSocket(d.SocketPath))
		}
	}},
	{"AwaitingVerdict_Timeout_BackingOff", func(t *testing.T, log *testkit.Buffer, name string) {
		s, d, _ := setupOpts(t, config.DevicePlugin, true, Options{Log: log.Logger()}, func(d *config.Driver) {
			d.RegistrationTimeout = 300 * time.Millisecond
			slowBackoff(d)
		})
		awaitTransition(t, log, name)
		if st := statusOf(s, d.Name); st.Phase != BackingOff || !strings.Contains(st.LastError, "no registration verdict from kubelet within 300ms") {
			t.Errorf("status %+v, want BackingOff after the timeout", st)
		}
	}},
	{"AwaitingVerdict_SocketGone_WaitingForEndpoint", func(t *testing.T, log *testkit.Buffer, name string) {
		_, d, _ := setupOpts(t, config.DevicePlugin, true, Options{Log: log.Logger()}, slowBackoff)
		awaitSocket(t, d)
		first := mustID(t, d.SocketPath)
		if err := os.Remove(d.SocketPath); err != nil {
			t.Fatal(err)
		}
		awaitTransition(t, log, name)
		testkit.Eventually(t, 5*time.Second, "the socket published again at once", func() bool {
			id, _, err := fsid.Stat(d.SocketPath)
			return err == nil && id != first
		})
	}},
	{"AwaitingVerdict_EndpointDown_AwaitingVerdict", func(t *testing.T, log *testkit.Buffer, name string) {
		s, d, e := setupOpts(t, config.DRAPlugin, true, Options{Log: log.Logger()}, nil)
		awaitSocket(t, d)
		first := mustID(t, d.SocketPath)
		crash(t, s, d, e)
		awaitTransition(t, log, name)
		if st := statusOf(s, d.Name); st.Phase != Serving || mustID(t, d.SocketPath) != first {
			t.Errorf("status %+v, want Serving on the same socket", st)
		}
	}},
	{"AwaitingVerdict_EndpointRestarted_WaitingForEndpoint", func(t *testing.T, log *testkit.Buffer, name string) {
		s, d, e := setupOpts(t, config.DRAPlugin, true, Options{Log: log.Logger()}, nil)
		awaitSocket(t, d)
		first := mustID(t, d.SocketPath)
		crash(t, s, d, e)
		startEndpoint(t, d.LocalEndpoint, "")
		awaitTransition(t, log, name)
		testkit.Eventually(t, 5*time.Second, "a new registration socket", func() bool {
			id, _, err := fsid.Stat(d.SocketPath)
			return err == nil && id != first
		})
	}},
	{"AwaitingVerdict_EndpointMoved_WaitingForEndpoint", func(t *testing.T, log *testkit.Buffer, name string) {
		// A device plugin with no view of kubelet's: no rollover, a new registration under the
		// new path.
		d := patternDriver(testkit.ShortDir(t), config.DevicePlugin, "dp.*")
		old := startInstance(t, d, "dp.1")
		s := runSupervisor(t, Options{Log: log.Logger()})
		s.Start(d)
		awaitSocket(t, d)
		old.Stop()
		startInstance(t, d, "dp.2")
		awaitTransition(t, log, name)
		// In another path (swapsPaths), the first one removed.
		testkit.Eventually(t, 5*time.Second, "a new registration socket in the second path, the first removed", func() bool {
			return testkit.IsSocket(d.AltSocketPath) && !testkit.IsSocket(d.SocketPath)
		})
		if info := register(t, d.AltSocketPath, true, ""); info.Endpoint != filepath.Join(filepath.Dir(d.LocalEndpoint), "dp.2") {
			t.Errorf("GetInfo's endpoint %q, want dp.2", info.Endpoint)
		}
	}},
	{"AwaitingVerdict_EndpointMoved_FallingBack", fallBackToANewerInstance},
	{"Registered_Accepted_Registered", func(t *testing.T, log *testkit.Buffer, name string) {
		s, d, _ := setupOpts(t, config.DevicePlugin, true, Options{Log: log.Logger()}, nil)
		awaitSocket(t, d)
		registerAndWait(t, s, d)
		first := mustID(t, d.SocketPath)
		register(t, d.SocketPath, true, "") // kubelet registers the same socket again (it restarted)
		awaitTransition(t, log, name)
		if st := statusOf(s, d.Name); st.Results[ResultRegistered] != 2 || st.Attempts != 1 || mustID(t, d.SocketPath) != first {
			t.Errorf("status %+v, want two registrations of the one socket", st)
		}
	}},
	{"Registered_Rejected_BackingOff", func(t *testing.T, log *testkit.Buffer, name string) {
		s, d, _ := setupOpts(t, config.DevicePlugin, true, Options{Log: log.Logger()}, slowBackoff)
		awaitSocket(t, d)
		registerAndWait(t, s, d)
		register(t, d.SocketPath, false, "no")
		awaitTransition(t, log, name)
		if st := statusOf(s, d.Name); st.Phase != BackingOff || testkit.IsSocket(d.SocketPath) {
			t.Errorf("status %+v, want BackingOff with the socket removed", st)
		}
	}},
	{"Registered_SocketGone_WaitingForEndpoint", func(t *testing.T, log *testkit.Buffer, name string) {
		s, d, _ := setupOpts(t, config.CSIPlugin, true, Options{Log: log.Logger()}, slowBackoff)
		awaitSocket(t, d)
		registerAndWait(t, s, d)
		if err := os.Remove(d.SocketPath); err != nil {
			t.Fatal(err)
		}
		awaitTransition(t, log, name)
		testkit.Eventually(t, 5*time.Second, "the socket published again at once", func() bool { return testkit.IsSocket(d.SocketPath) })
		if st := statusOf(s, d.Name); st.Recreations[ReasonSocketRemoved] != 1 {
			t.Errorf("recreations %v, want one for %s", st.Recreations, ReasonSocketRemoved)
		}
	}},
	{"Registered_EndpointDown_Registered", func(t *testing.T, log *testkit.Buffer, name string) {
		s, d, e := setupOpts(t, config.CSIPlugin, true, Options{Log: log.Logger()}, nil)
		awaitSocket(t, d)
		registerAndWait(t, s, d)
		first := mustID(t, d.SocketPath)
		crash(t, s, d, e)
		awaitTransition(t, log, name)
		if st := statusOf(s, d.Name); st.Phase != Registered || mustID(t, d.SocketPath) != first {
			t.Errorf("status %+v, want Registered on the same socket", st)
		}
	}},
	{"Registered_EndpointRestarted_Restarting", func(t *testing.T, log *testkit.Buffer, name string) {
		s, d, e := setupOpts(t, config.DRAPlugin, true, Options{Log: log.Logger()}, nil)
		awaitSocket(t, d)
		registerAndWait(t, s, d)
		first := mustID(t, d.SocketPath)
		crash(t, s, d, e)
		startEndpoint(t, d.LocalEndpoint, "")
		awaitTransition(t, log, name)
		awaitTransition(t, log, "Restarting_EndpointUp_Registered")
		if st := statusOf(s, d.Name); st.Phase != Registered || mustID(t, d.SocketPath) != first {
			t.Errorf("status %+v, want Registered on the same socket", st)
		}
	}},
	{"Registered_EndpointRestarted_WaitingForEndpoint", func(t *testing.T, log *testkit.Buffer, name string) {
		s, d, e := setupOpts(t, config.DevicePlugin, true, Options{Log: log.Logger()}, nil)
		awaitSocket(t, d)
		registerAndWait(t, s, d)
		first := mustID(t, d.SocketPath)
		crash(t, s, d, e)
		startEndpoint(t, d.LocalEndpoint, "")
		awaitTransition(t, log, name)
		testkit.Eventually(t, 5*time.Second, "a new registration socket", func() bool {
			id, _, err := fsid.Stat(d.SocketPath)
			return err == nil && id != first
		})
	}},
	{"Registered_EndpointMoved_WaitingForEndpoint", func(t *testing.T, log *testkit.Buffer, name string) {
		s, d, _ := registeredDRAPattern(t, Options{Log: log.Logger()})
		first := mustID(t, d.SocketPath)
		startInstance(t, d, "dra-b.sock")
		awaitTransition(t, log, name)
		testkit.Eventually(t, 5*time.Second, "the second registration socket", func() bool { return testkit.IsSocket(d.AltSocketPath) })
		if st := statusOf(s, d.Name); st.Phase != Registered || mustID(t, d.SocketPath) != first {
			t.Errorf("status %+v, want Registered, the first socket untouched", st)
		}
	}},
	{"Registered_EndpointMoved_FallingBack", func(t *testing.T, log *testkit.Buffer, name string) {
		_, d, _, b := rolledOver(t, Options{Log: log.Logger()})
		first := mustID(t, d.SocketPath)
		b.Stop()
		awaitTransition(t, log, name)
		testkit.Eventually(t, 5*time.Second, "the new instance's registration withdrawn", func() bool { return !testkit.IsSocket(d.AltSocketPath) })
		if mustID(t, d.SocketPath) != first {
			t.Error("the previous registration's socket was replaced")
		}
	}},
	{"Registered_DevicesDropped_WaitingForEndpoint", func(t *testing.T, log *testkit.Buffer, name string) {
		m := startDevicePluginMove(t, Options{Log: log.Logger()}, true)
		startInstance(t, m.d, "dp.2")
		m.awaitBeside(m.d.AltSocketPath, "dp.2")
		m.old.Stop()
		testkit.Eventually(t, 5*time.Second, "the old registration withdrawn", func() bool { return !testkit.IsSocket(m.d.SocketPath) })
		m.kubelet.Set(m.d.Name, 0) // kubelet dropped the resource with dp.1's registration
		awaitTransition(t, log, name)
		// Published again in the third path: kubelet may still hold both others.
		if at := m.awaitSwap(m.d.AltSocketPath, "dp.2"); at != m.d.SparePath {
			t.Errorf("dp.2 published again in %s, want %s", at, m.d.SparePath)
		}
	}},
	{"BackingOff_BackoffOver_WaitingForEndpoint", func(t *testing.T, log *testkit.Buffer, name string) {
		_, d, _ := setupOpts(t, config.CSIPlugin, true, Options{Log: log.Logger()}, nil)
		awaitSocket(t, d)
		register(t, d.SocketPath, false, "no")
		awaitTransition(t, log, name)
		awaitSocket(t, d)
	}},
	{"Registered_Reload_Registered", func(t *testing.T, log *testkit.Buffer, name string) {
		// An edit of the loop policy alone touches no socket; the next backoff follows it.
		s, d, _ := setupOpts(t, config.DevicePlugin, true, Options{Log: log.Logger()}, nil)
		awaitSocket(t, d)
		registerAndWait(t, s, d)
		first := mustID(t, d.SocketPath)
		s.Update(withPolicy(d, time.Minute, 0))
		testkit.Never(t, 300*time.Millisecond, "the socket touched by an edit of the loop policy", func() bool {
			id, _, err := fsid.Stat(d.SocketPath)
			return err != nil || id != first
		})
		register(t, d.SocketPath, false, "no")
		awaitTransition(t, log, name)
		awaitTransition(t, log, "Registered_Rejected_BackingOff")
		if wait := time.Until(statusOf(s, d.Name).NextAttempt); wait < 30*time.Second {
			t.Errorf("next attempt in %s, want the new policy's minute", wait)
		}
	}},
	{"BackingOff_Reload_BackingOff", func(t *testing.T, log *testkit.Buffer, name string) {
		// A backoff of a minute under way follows a new policy's 50 ms at once.
		s, d, _ := setupOpts(t, config.DevicePlugin, true, Options{Log: log.Logger()}, slowBackoff)
		awaitSocket(t, d)
		first := mustID(t, d.SocketPath)
		register(t, d.SocketPath, false, "no")
		awaitTransition(t, log, "AwaitingVerdict_Rejected_BackingOff")
		s.Update(withPolicy(d, 50*time.Millisecond, 0))
		awaitTransition(t, log, name)
		testkit.Eventually(t, 5*time.Second, "a new socket published, not a minute later", func() bool {
			id, _, err := fsid.Stat(d.SocketPath)
			return err == nil && id != first
		})
	}},
	{"AwaitingVerdict_Reload_AwaitingVerdict", func(t *testing.T, log *testkit.Buffer, name string) {
		// An attempt awaiting its verdict without a timeout gets the new policy's, counted
		// from its socket's publication.
		s, d, _ := setupOpts(t, config.DRAPlugin, true, Options{Log: log.Logger()}, slowBackoff)
		awaitTransition(t, log, "Publishing_PathFree_AwaitingVerdict")
		s.Update(withPolicy(d, time.Minute, 300*time.Millisecond))
		awaitTransition(t, log, name)
		awaitTransition(t, log, "AwaitingVerdict_Timeout_BackingOff")
		if st := statusOf(s, d.Name); !strings.Contains(st.LastError, "within 300ms") {
			t.Errorf("last error %q, want the new timeout's", st.LastError)
		}
	}},
	{"Registered_Removed_Stopped", func(t *testing.T, log *testkit.Buffer, name string) {
		s, d, _ := setupOpts(t, config.CSIPlugin, true, Options{Log: log.Logger()}, nil)
		awaitSocket(t, d)
		registerAndWait(t, s, d)
		s.Stop(d.Name)
		awaitTransition(t, log, name)
		if testkit.IsSocket(d.SocketPath) {
			t.Error("the socket of a driver removed is still there")
		}
	}},
	{"Registered_Shutdown_Stopped", func(t *testing.T, log *testkit.Buffer, name string) {
		dir := testkit.ShortDir(t)
		d := testDriver(dir, "nfs.csi.k8s.io", config.CSIPlugin, filepath.Join(dir, "ep", "csi.sock"))
		startEndpoint(t, d.LocalEndpoint, d.Name)
		s, err := New(Options{Log: log.Logger()})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- s.Run(ctx) }()
		s.Start(d)
		awaitSocket(t, d)
		registerAndWait(t, s, d)
		first := mustID(t, d.SocketPath)
		cancel()
		<-done
		awaitTransition(t, log, name)
		if id, _, err := fsid.Stat(d.SocketPath); err != nil || id != first {
			t.Errorf("the socket after a shutdown: %v, %v; want it left in place", id, err)
		}
	}},
	{"Registered_HandOver_Stopped", func(t *testing.T, log *testkit.Buffer, name string) {
		reg, ds, a, before := registeredMultiregLog(t, log.Logger())
		startMultireg(t, reg, ds)
		if n := a.handedOver(t); n != len(ds) {
			t.Errorf("%d sockets handed over, want %d", n, len(ds))
		}
		awaitTransition(t, log, name)
		if now := ids(t, ds); !slices.Equal(now, before) {
			t.Errorf("sockets replaced: %v, were %v", now, before)
		}
	}},
	{"AwaitingVerdict_PrevSocketGone_AwaitingVerdict", func(t *testing.T, log *testkit.Buffer, name string) {
		// A rollover's new instance awaits kubelet's verdict when someone removes the old
		// registration's socket: kubelet holds none of the driver's now.
		s, d, _ := registeredDRAPattern(t, Options{Log: log.Logger()})
		startInstance(t, d, "dra-b.sock")
		testkit.Eventually(t, 5*time.Second, "the second registration socket", func() bool { return testkit.IsSocket(d.AltSocketPath) })
		alt := mustID(t, d.AltSocketPath)
		if err := os.Remove(d.SocketPath); err != nil {
			t.Fatal(err)
		}
		awaitTransition(t, log, name)
		if st := statusOf(s, d.Name); st.Phase != Serving || st.Socket != d.AltSocketPath || mustID(t, d.AltSocketPath) != alt {
			t.Errorf("status %+v, want Serving on the second socket, untouched", st)
		}
	}},
	{"Registered_PrevSocketGone_Registered", func(t *testing.T, log *testkit.Buffer, name string) {
		s, d, _, _ := rolledOver(t, Options{Log: log.Logger()})
		alt := mustID(t, d.AltSocketPath)
		if err := os.Remove(d.SocketPath); err != nil {
			t.Fatal(err)
		}
		awaitTransition(t, log, name)
		if st := statusOf(s, d.Name); st.Phase != Registered || st.Socket != d.AltSocketPath || mustID(t, d.AltSocketPath) != alt {
			t.Errorf("status %+v, want Registered on the second socket, untouched", st)
		}
	}},
	{"Registered_OldInstanceGone_Registered", func(t *testing.T, log *testkit.Buffer, name string) {
		s, d, a, _ := rolledOver(t, Options{Log: log.Logger()})
		alt := mustID(t, d.AltSocketPath)
		// Once kubelet's verdict on dra-b is taken: an old instance gone before settles in it.
		awaitTransitions(t, log, "AwaitingVerdict_Accepted_Registered", 2)
		a.Stop()
		awaitTransition(t, log, name)
		testkit.Eventually(t, 5*time.Second, "the old registration withdrawn", func() bool { return !testkit.IsSocket(d.SocketPath) })
		if st := statusOf(s, d.Name); st.Phase != Registered || mustID(t, d.AltSocketPath) != alt {
			t.Errorf("status %+v, want Registered on the second socket, untouched", st)
		}
	}},
	{"AwaitingVerdict_MoveVerified_AwaitingVerdict", func(t *testing.T, log *testkit.Buffer, name string) {
		// A device plugin's new instance awaits its verdict beside the old registration when
		// someone removes the old one's socket: the move ends with nothing to verify.
		m := startDevicePluginMove(t, Options{Log: log.Logger()}, true)
		startInstance(t, m.d, "dp.2")
		testkit.Eventually(t, 5*time.Second, "the second registration socket", func() bool { return testkit.IsSocket(m.d.AltSocketPath) })
		if err := os.Remove(m.d.SocketPath); err != nil {
			t.Fatal(err)
		}
		awaitTransition(t, log, "AwaitingVerdict_PrevSocketGone_AwaitingVerdict")
		awaitTransition(t, log, name)
		if strings.Contains(log.String(), "kubelet kept the resource's devices") {
			t.Error("a move that ended unverified says kubelet kept the devices")
		}
	}},
	{"Registered_MoveVerified_Registered", func(t *testing.T, log *testkit.Buffer, name string) {
		m := startDevicePluginMove(t, Options{Log: log.Logger()}, true)
		startInstance(t, m.d, "dp.2")
		m.awaitBeside(m.d.AltSocketPath, "dp.2")
		m.old.Stop()
		awaitTransition(t, log, "Registered_OldInstanceGone_Registered")
		awaitTransition(t, log, name)
		testkit.Eventually(t, 5*time.Second, "the verification's conclusion", func() bool {
			return strings.Contains(log.String(), "kubelet kept the resource's devices through the move")
		})
	}},
	{"TakingOver_EndpointUp_TakingOver", func(t *testing.T, log *testkit.Buffer, name string) {
		// A CSI driver restarted during the hand-over: its NodeGetInfo decides, and the driver
		// is removed while it answers: nothing is decided, and the loop ends.
		dir := testkit.ShortDir(t)
		d := testDriver(dir, "nfs.csi.k8s.io", config.CSIPlugin, filepath.Join(dir, "ep", "csi.sock"))
		entered := startStuckCSINode(t, d.LocalEndpoint, d.Name)
		id, f := handedSocket(t, d)
		snap := handedWith(d, id, f, true, id) // an endpoint identity that is not the endpoint's
		hd := snap.Take(d.Name)
		hd.NodeInfo = []byte("\n\x06node-a") // NodeGetInfo's answer recorded: {node_id: "node-a"}
		snap.Add(hd)
		s := runSupervisor(t, Options{Log: log.Logger()})
		s.TakeOver(snap)
		s.Start(d)
		awaitClosed(t, entered, "the held call")
		s.Stop(d.Name)
		awaitTransition(t, log, name)
		awaitTransition(t, log, "TakingOver_Removed_Stopped")
	}},
	{"Restarting_EndpointUp_Restarting", func(t *testing.T, log *testkit.Buffer, name string) {
		s, d, e := registeredCSINode(t, log, "node-a")
		crash(t, s, d, e)
		entered := startStuckCSINode(t, d.LocalEndpoint, d.Name)
		awaitTransition(t, log, "Registered_EndpointRestarted_Restarting")
		awaitClosed(t, entered, "the held call")
		s.Stop(d.Name)
		awaitTransition(t, log, name)
		awaitTransition(t, log, "Restarting_Removed_Stopped")
	}},
	{"Registered_EndpointMoved_Registered", func(t *testing.T, log *testkit.Buffer, name string) {
		// After a rollover, a newer instance answers: whether the registered new instance is
		// gone decides, and the driver is removed while that probe runs. Only the act's probe
		// is held: one of dra-b made once dra-c answers (a look probes dra-b only when dra-c
		// does not, between its bind and its listen).
		d := patternDriver(testkit.ShortDir(t), config.DRAPlugin, "dra-*.sock")
		a := startInstance(t, d, "dra-a.sock")
		ageFile(t, a.Path(), 2*time.Minute)
		var armed atomic.Bool
		var bPath, cPath string
		entered := make(chan struct{})
		s := runSupervisor(t, Options{Log: log.Logger()})
		s.env.probe = func(ctx context.Context, spec config.Driver) error {
			if armed.Load() && spec.LocalEndpoint == bPath && answers(cPath) && armed.CompareAndSwap(true, false) {
				close(entered)
				<-ctx.Done()
				return ctx.Err()
			}
			return probe.Endpoint(ctx, spec)
		}
		s.Start(d)
		awaitSocket(t, d)
		registerAndWait(t, s, d)
		b := startInstance(t, d, "dra-b.sock")
		ageFile(t, b.Path(), time.Minute)
		bPath, cPath = b.Path(), filepath.Join(filepath.Dir(b.Path()), "dra-c.sock")
		testkit.Eventually(t, 5*time.Second, "the second registration socket", func() bool { return testkit.IsSocket(d.AltSocketPath) })
		register(t, d.AltSocketPath, true, "")
		awaitTransitions(t, log, "AwaitingVerdict_Accepted_Registered", 2) // dra-a's, then dra-b's
		armed.Store(true)
		startInstance(t, d, "dra-c.sock")
		awaitClosed(t, entered, "the held call")
		s.Stop(d.Name)
		awaitTransition(t, log, name)
		awaitTransition(t, log, "Registered_Removed_Stopped")
	}},
}

// fallBackToANewerInstance: a DRA driver's rollover to dra-b is under way (its socket not
// asked yet) when a newer dra-c answers: the loop withdraws dra-b's socket, falls back to
// dra-a's registration, and rolls over from it to dra-c.
func fallBackToANewerInstance(t *testing.T, log *testkit.Buffer, name string) {
	s, d, _ := registeredDRAPattern(t, Options{Log: log.Logger()})
	first := mustID(t, d.SocketPath)
	startInstance(t, d, "dra-b.sock")
	testkit.Eventually(t, 5*time.Second, "the second registration socket", func() bool { return testkit.IsSocket(d.AltSocketPath) })
	forB := mustID(t, d.AltSocketPath)
	c := startInstance(t, d, "dra-c.sock")
	awaitTransition(t, log, "AwaitingVerdict_EndpointMoved_FallingBack")
	awaitTransition(t, log, "FallingBack_EndpointUp_Publishing")
	awaitTransition(t, log, name)
	testkit.Eventually(t, 5*time.Second, "the second registration socket published for dra-c", func() bool {
		id, _, err := fsid.Stat(d.AltSocketPath)
		return err == nil && id != forB
	})
	if info := register(t, d.AltSocketPath, true, ""); info.Endpoint != c.Path() {
		t.Errorf("the second socket's endpoint %q, want dra-c", info.Endpoint)
	}
	if st := statusOf(s, d.Name); st.Phase != Registered || mustID(t, d.SocketPath) != first {
		t.Errorf("status %+v, want Registered, the first socket untouched", st)
	}
}

// slowBackoff makes a driver back off for a minute: a test sees it in BackingOff.
func slowBackoff(d *config.Driver) {
	d.Backoff = config.Backoff{InitialInterval: time.Minute, MaxInterval: time.Minute, Multiplier: 2}
}

// withPolicy is d with a backoff of interval, at most interval, and a registration timeout.
func withPolicy(d config.Driver, interval, timeout time.Duration) config.Driver {
	d.Backoff = config.Backoff{InitialInterval: interval, MaxInterval: interval, Multiplier: 2}
	d.RegistrationTimeout = timeout
	return d
}

// awaitClosed waits for c to be closed, failing the test after 10 s.
func awaitClosed(t *testing.T, c <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-c:
	case <-time.After(10 * time.Second):
		t.Fatalf("timed out after 10s waiting for %s", what)
	}
}

// answers reports whether something accepts a connection at path now.
func answers(path string) bool {
	c, err := net.Dial("unix", path)
	if err != nil {
		return false
	}
	c.Close()
	return true
}

// startStuckCSINode serves a CSI driver's endpoint at path whose NodeGetInfo never answers: it
// waits until the caller gives up. entered is closed when the first call comes.
func startStuckCSINode(t *testing.T, path, name string) (entered <-chan struct{}) {
	t.Helper()
	c := make(chan struct{})
	var once sync.Once
	serveEndpoint(t, path, func(srv *grpc.Server) {
		csi.RegisterIdentityServer(srv, testkit.Identity{Name: name})
		csi.RegisterNodeServer(srv, stuckNode{entered: func() { once.Do(func() { close(c) }) }})
	})
	return c
}

// stuckNode is a CSI Node service whose NodeGetInfo waits until the caller gives up.
type stuckNode struct {
	csi.UnimplementedNodeServer
	entered func()
}

func (n stuckNode) NodeGetInfo(ctx context.Context, _ *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	n.entered()
	<-ctx.Done()
	return nil, ctx.Err()
}

// handedSocket publishes d's registration socket as a predecessor would have, and returns its
// identity and a copy of its descriptor, as a hand-over passes it.
func handedSocket(t *testing.T, d config.Driver) (fsid.ID, *os.File) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(d.SocketPath), 0o750); err != nil {
		t.Fatal(err)
	}
	l, id, err := sockfile.Publish(d.SocketPath, nil)
	if err != nil {
		t.Fatal(err)
	}
	f, err := l.File()
	l.Close()
	if err != nil {
		t.Fatal(err)
	}
	return id, f
}

// handedWith is the snapshot a predecessor hands over for d on its socket of identity id (f,
// its descriptor), registered or not, having last probed the endpoint socket ep.
func handedWith(d config.Driver, id fsid.ID, f *os.File, registered bool, ep fsid.ID) *handover.Snapshot {
	phase := Serving
	if registered {
		phase = Registered
	}
	snap := &handover.Snapshot{}
	snap.Add(&handover.Driver{Spec: d, Endpoint: d.Endpoint, LocalEndpoint: d.LocalEndpoint, Status: handedStatus(DriverStatus{Phase: phase}), EndpointID: ep,
		Sockets: []*handover.Socket{{Path: d.SocketPath, ID: id, Generation: 1, Registered: registered, Endpoint: d.Endpoint, LocalEndpoint: d.LocalEndpoint, File: f}}})
	return snap
}

// TestTransitions runs transitionTests; every transition each logs must be a row of the table.
func TestTransitions(t *testing.T) {
	for _, tt := range transitionTests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var log testkit.Buffer
			t.Cleanup(func() {
				if t.Failed() {
					t.Log(log.String())
				}
			})
			tt.run(t, &log, tt.name)
			for _, tr := range transitionsIn(log.String()) {
				if !inTable(tr) {
					t.Errorf("the loop made %s, which is not in the table", tr)
				}
			}
		})
	}
}

// TestTransitionsTested: every destination of every row of the table has a test; a row of any
// state has one from some state.
func TestTransitionsTested(t *testing.T) {
	var names []string
	for _, tt := range transitionTests {
		if !inTable(tt.name) {
			t.Errorf("%s names no transition of the table", tt.name)
		}
		names = append(names, tt.name)
	}
	for _, r := range rows {
		if r.from != anyState {
			for _, n := range r.rowNames() {
				if !slices.Contains(names, n) {
					t.Errorf("no test for %s", n)
				}
			}
			continue
		}
		if !slices.ContainsFunc(names, func(n string) bool { return strings.Contains(n, "_"+r.on.String()+"_") }) {
			t.Errorf("no test for %s from any state", r.on)
		}
	}
}
