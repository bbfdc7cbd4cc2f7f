package faults

import (
	"testing"
	"time"

	"multireg.dev/multireg/e2e/internal/fileid"
	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/kubelet"
	"multireg.dev/multireg/e2e/mrproc"
	"multireg.dev/multireg/e2e/plugins"
	"multireg.dev/multireg/e2e/testenv"
)

// The log lines of a driver's restart: its registration kept (a CSI driver that answers
// NodeGetInfo as before; a DRA driver, always), or made again.
const (
	restartKept         = "driver endpoint restarted; NodeGetInfo unchanged, the registration stays"
	restartKeptDRA      = "driver endpoint restarted; kubelet reconnects to it by itself, the registration stays"
	restartReregistered = "driver endpoint restarted; registering again"
)

// keptLine is the log line of a restart that keeps the registration of a driver of type typ,
// or "" when its restarts always register it again.
func keptLine(typ string) string {
	switch typ {
	case "CSIPlugin":
		return restartKept
	case "DRAPlugin":
		return restartKeptDRA
	}
	return ""
}

// Fault: a registered CSI driver restarts (its endpoint socket removed and created anew).
// When it answers NodeGetInfo as before, kubelet hears nothing — no deregistration, no
// registration, the same socket — and the driver stays Registered. When its node ID changed,
// kubelet must learn it: one deregistration and one registration. Other drivers never move.
func TestCSIEndpointRestart(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, nodeID string
		reregistered bool
	}{
		{"same NodeGetInfo", plugins.DefaultNodeID, false},
		{"another node ID", "e2e-node-2", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			ds := testenv.Mixed("r", 6)
			victim := ds[3] // a CSI driver, answering NodeGetInfo with DefaultNodeID
			others := testenv.Without(ds, victim.Name)
			p := e.startAll(ds)
			before := e.snap(others)
			sock := fileid.Of(e.SocketPath(victim))
			regs := e.K.Counts(victim.Name)
			st, _ := p.Status(t).Driver(victim.Name)

			e.AwaitNodeInfoRecorded(p, victim)
			e.StopEndpoint(victim)
			waitDriver(t, p, victim.Name, "/status to show the endpoint down", func(d mrproc.DriverStatus) bool { return !d.EndpointUp })
			ep, err := plugins.StartNode(e.EndpointPath(victim), victim.Type, victim.Name, tc.nodeID)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(ep.Stop)

			if tc.reregistered {
				wait.For(t, registerTimeout, "one deregistration and one registration", func() bool {
					c := e.K.Counts(victim.Name)
					return c.Registrations == regs.Registrations+1 && c.Deregistrations == regs.Deregistrations+1 && e.K.Registered(victim.Name)
				})
				waitCount(t, p, restartReregistered, victim.Name, 1)
				logGap(t, e.K.EventsFor(victim.Name))
			} else {
				waitDriver(t, p, victim.Name, "/status to show the endpoint up", func(d mrproc.DriverStatus) bool { return d.EndpointUp })
				wait.Never(t, quietPeriod, "kubelet heard of the restart, or the socket changed", func() bool {
					return e.K.Counts(victim.Name) != regs || !e.K.Registered(victim.Name) || fileid.Of(e.SocketPath(victim)) != sock
				})
				waitCount(t, p, restartKept, victim.Name, 1)
				if n := p.Count(restartReregistered, victim.Name); n != 0 {
					t.Errorf("%d %q log lines, want none", n, restartReregistered)
				}
			}
			d := waitDriver(t, p, victim.Name, "Registered with the endpoint up", func(d mrproc.DriverStatus) bool { return d.Phase == "Registered" && d.EndpointUp })
			want := st.Attempts
			if tc.reregistered {
				want++ // the new socket
			}
			if d.Attempts != want {
				t.Errorf("%d registration attempts after the restart, want %d", d.Attempts, want)
			}
			c := e.K.Counts(victim.Name)
			t.Logf("kubelet's calls for %s: before the restart %+v, after %+v", victim.Name, regs, c)
			e.assertUnmoved(before, others)
		})
	}
}

// logGap logs how long kubelet held no registration of a driver: from its last deregistration
// to the registration after it.
func logGap(t *testing.T, events []kubelet.Event) {
	var gone time.Time
	for _, ev := range events {
		switch {
		case ev.Kind == kubelet.EventDeRegister:
			gone = ev.Time
		case ev.Kind == kubelet.EventRegister && !gone.IsZero():
			t.Logf("kubelet held no registration for %s", ev.Time.Sub(gone).Round(time.Millisecond))
		}
	}
}
