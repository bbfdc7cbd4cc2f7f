package registrar

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/testkit"
)

// registeredCSINode starts a CSI driver whose endpoint answers NodeGetInfo with nodeID, on a
// supervisor logging into log, registered by a kubelet that registers every new socket (see
// runSlowKubelet), and asked NodeGetInfo by multireg. A registration timeout of 1s is in force: a registration kept across a
// restart must not be timed out.
func registeredCSINode(t *testing.T, log *testkit.Buffer, nodeID string) (*Supervisor, config.Driver, *servedEndpoint) {
	t.Helper()
	dir := testkit.ShortDir(t)
	d := testDriver(dir, "nfs.csi.k8s.io", config.CSIPlugin, filepath.Join(dir, "ep", "csi.sock"))
	d.RegistrationTimeout = time.Second
	e, calls := startCSINode(t, d.LocalEndpoint, d.Name, nodeID)
	s := runSupervisor(t, Options{Log: log.Logger()})
	s.Start(d)
	runSlowKubelet(t, d.SocketPath, 0)
	testkit.Eventually(t, 5*time.Second, "Registered", func() bool { return statusOf(s, d.Name).Phase == Registered })
	// multireg asks NodeGetInfo itself right after kubelet's verdict; the answer must have
	// reached it, not only the call the endpoint, before a test stops the endpoint.
	testkit.Eventually(t, 5*time.Second, "multireg's NodeGetInfo recorded", func() bool {
		return strings.Contains(log.String(), "NodeGetInfo recorded")
	})
	if n := calls.Load(); n != 1 {
		t.Fatalf("NodeGetInfo calls after the registration: %d, want multireg's 1", n)
	}
	return s, d, e
}

// TestCSIRestartSameNodeInfoKeepsRegistration: a registered CSI driver restarts and answers
// NodeGetInfo as before: its registration socket stays (kubelet sees no event and keeps the
// driver in CSINode), no socket is published, and no recreation is counted.
func TestCSIRestartSameNodeInfoKeepsRegistration(t *testing.T) {
	var log testkit.Buffer
	s, d, e := registeredCSINode(t, &log, "node-a")
	first := mustID(t, d.SocketPath)

	crash(t, s, d, e)
	_, calls := startCSINode(t, d.LocalEndpoint, d.Name, "node-a")
	const kept = "driver endpoint restarted; NodeGetInfo unchanged, the registration stays"
	testkit.Eventually(t, 5*time.Second, "the restart seen and the registration kept", func() bool { return strings.Contains(log.String(), kept) })
	testkit.Never(t, 1500*time.Millisecond, "the registration socket replaced or removed", func() bool {
		id, _, err := fsid.Stat(d.SocketPath)
		return err != nil || id != first
	})
	st := statusOf(s, d.Name)
	if st.Phase != Registered || !st.EndpointUp || st.Attempts != 1 || st.Results[ResultRegistered] != 1 || st.Recreations[ReasonEndpointRestarted] != 0 || st.EndpointRestarts != 1 {
		t.Errorf("status after a restart with the same NodeGetInfo: %+v, want Registered, endpoint up, 1 attempt, 1 registration (kubelet asked GetInfo once), no recreation, 1 endpoint restart", st)
	}
	if n := calls.Load(); n != 1 {
		t.Errorf("the restarted driver was asked NodeGetInfo %d times, want 1", n)
	}
	if n := strings.Count(log.String(), kept); n != 1 {
		t.Errorf("logged %q %d times, want once", kept, n)
	}
}

// TestCSIRestartOtherNodeIDReregisters: a registered CSI driver restarts and answers
// NodeGetInfo with another node ID: kubelet must learn it, so the driver is registered again
// on a new socket, and the recreation is counted.
func TestCSIRestartOtherNodeIDReregisters(t *testing.T) {
	var log testkit.Buffer
	s, d, e := registeredCSINode(t, &log, "node-a")
	first := mustID(t, d.SocketPath)

	crash(t, s, d, e)
	startCSINode(t, d.LocalEndpoint, d.Name, "node-b")
	testkit.Eventually(t, 5*time.Second, "registered again on a new socket", func() bool {
		st := statusOf(s, d.Name)
		id, _, err := fsid.Stat(d.SocketPath)
		return err == nil && id != first && st.Phase == Registered && st.Results[ResultRegistered] == 2
	})
	if st := statusOf(s, d.Name); st.Recreations[ReasonEndpointRestarted] != 1 || st.Attempts != 2 {
		t.Errorf("status after a restart with another node ID: %+v, want 2 attempts, 1 recreation for endpoint_restarted", st)
	}
	if !strings.Contains(log.String(), "NodeGetInfo changed") {
		t.Errorf("the re-registration's reason is not logged:\n%s", log.String())
	}
}

// TestCSIRestartNodeGetInfoFailsReregisters: a registered CSI driver restarts without its
// Node service: multireg cannot tell that kubelet's view holds, so it registers the driver
// again.
func TestCSIRestartNodeGetInfoFailsReregisters(t *testing.T) {
	var log testkit.Buffer
	s, d, e := registeredCSINode(t, &log, "node-a")
	first := mustID(t, d.SocketPath)

	crash(t, s, d, e)
	startEndpoint(t, d.LocalEndpoint, d.Name) // Identity only: NodeGetInfo is unimplemented
	testkit.Eventually(t, 5*time.Second, "registered again on a new socket", func() bool {
		st := statusOf(s, d.Name)
		id, _, err := fsid.Stat(d.SocketPath)
		return err == nil && id != first && st.Phase == Registered && st.Results[ResultRegistered] == 2
	})
	if st := statusOf(s, d.Name); st.Recreations[ReasonEndpointRestarted] != 1 || st.EndpointRestarts != 1 {
		t.Errorf("recreations %v and %d endpoint restarts, want 1 for endpoint_restarted and 1", st.Recreations, st.EndpointRestarts)
	}
	if !strings.Contains(log.String(), "CSI NodeGetInfo on "+d.LocalEndpoint) {
		t.Errorf("the failed NodeGetInfo is not logged:\n%s", log.String())
	}
}

// TestRestartPerType: a registered DRA driver that restarts keeps its registration socket
// (kubelet's DRA manager reconnects by itself); a device plugin is registered again on a new
// socket (kubelet's device manager needs a new registration for a new ListAndWatch).
func TestRestartPerType(t *testing.T) {
	for _, tt := range []struct {
		typ  string
		keep bool
	}{{config.DRAPlugin, true}, {config.DevicePlugin, false}} {
		t.Run(tt.typ, func(t *testing.T) {
			s, d, e := setup(t, tt.typ, nil)
			awaitSocket(t, d)
			registerAndWait(t, s, d)
			first := mustID(t, d.SocketPath)
			crash(t, s, d, e)
			startEndpoint(t, d.LocalEndpoint, "")
			if tt.keep {
				testkit.Eventually(t, 5*time.Second, "the restart seen", func() bool { return statusOf(s, d.Name).EndpointUp })
				testkit.Never(t, time.Second, "the registration socket replaced or removed", func() bool {
					id, _, err := fsid.Stat(d.SocketPath)
					return err != nil || id != first
				})
				if st := statusOf(s, d.Name); st.Phase != Registered || st.Attempts != 1 || st.Recreations[ReasonEndpointRestarted] != 0 {
					t.Errorf("status after the restart: %+v, want Registered, 1 attempt, no recreation", st)
				}
				return
			}
			testkit.Eventually(t, 5*time.Second, "a new socket after the restart", func() bool {
				id, _, err := fsid.Stat(d.SocketPath)
				return err == nil && id != first
			})
			if st := statusOf(s, d.Name); st.Recreations[ReasonEndpointRestarted] != 1 {
				t.Errorf("recreations after the restart: %v, want endpoint_restarted 1", st.Recreations)
			}
		})
	}
}

// crash stops the driver's endpoint as a crashing driver does (its socket removed), and waits
// for the loop to see it down.
func crash(t *testing.T, s *Supervisor, d config.Driver, e *servedEndpoint) {
	t.Helper()
	e.Stop()
	testkit.Eventually(t, 5*time.Second, "endpoint down", func() bool { return !statusOf(s, d.Name).EndpointUp })
}

// TestKeptRestartStaysRegistered: a registered CSI driver restarts and does not answer at
// once (its socket is there, nothing listens yet): kubelet still holds the registration, so
// the driver stays Registered — and ready — until it answers and the registration is kept.
func TestKeptRestartStaysRegistered(t *testing.T) {
	var log testkit.Buffer
	s, d, e := registeredCSINode(t, &log, "node-a")
	crash(t, s, d, e)
	deadSocket(t, d.LocalEndpoint) // created anew, not answering yet
	testkit.Eventually(t, 5*time.Second, "the probe of the restarted driver to fail", func() bool {
		return strings.Contains(statusOf(s, d.Name).LastError, "connection refused")
	})
	testkit.Never(t, 500*time.Millisecond, "the driver to leave Registered while it comes up", func() bool {
		return statusOf(s, d.Name).Phase != Registered
	})
	if err := os.Remove(d.LocalEndpoint); err != nil {
		t.Fatal(err)
	}
	startCSINode(t, d.LocalEndpoint, d.Name, "node-a")
	const kept = "driver endpoint restarted; NodeGetInfo unchanged, the registration stays"
	testkit.Eventually(t, 5*time.Second, "the registration kept", func() bool { return strings.Contains(log.String(), kept) })
	if st := statusOf(s, d.Name); st.Phase != Registered || st.LastError != "" {
		t.Errorf("after the kept restart: phase %s, last error %q; want Registered, none", st.Phase, st.LastError)
	}
}
