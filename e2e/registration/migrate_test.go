package registration

import (
	"os"
	"strings"
	"testing"
	"time"

	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"multireg.dev/multireg/e2e/internal/fileid"
	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/mrproc"
	"multireg.dev/multireg/e2e/plugins"
)

// Moving a driver from a node-driver-registrar sidecar to multireg, in the order
// docs/migrate-from-node-driver-registrar.md gives: the driver is added to multireg while the
// sidecar still serves its socket, then the sidecar is removed. multireg leaves a socket that
// another process serves alone (kubelet sees nothing), and publishes its own as soon as the
// sidecar's exit deletes it: one deregistration. "pod" recreates the whole driver pod, as
// removing a container from its template does: the driver restarts with the sidecar's exit.
func TestMigrateFromSidecar(t *testing.T) {
	for _, pod := range []bool{false, true} {
		t.Run(map[bool]string{false: "sidecar", true: "pod"}[pod], func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			d := driver{Name: "nfs.csi.example.com", Type: "CSIPlugin"}
			e.StartEndpoint(d)
			sidecar := e.ServeRegistrar(e.SocketPath(d), d.Name, e.EndpointPath(d))
			wait.For(t, registerTimeout, "the sidecar's registration", func() bool { return e.K.Registered(d.Name) })

			p := mrproc.Start(t, e.WriteConfig([]driver{d}))
			wait.For(t, registerTimeout, "multireg to wait behind the sidecar's socket", func() bool {
				return p.Count("registration failed", d.Name) > 0
			})
			wait.Never(t, 2*time.Second, "kubelet's registration moved while the sidecar serves", func() bool {
				c := e.K.Counts(d.Name)
				return c.Registrations != 1 || c.Deregistrations != 0
			})
			if code, body, err := p.Get(t, "/readyz"); err != nil || code == 200 || !strings.Contains(body, "served by another process") {
				t.Errorf("/readyz while the sidecar serves: %d %v\n%s\nwant 503 naming the reason", code, err, body)
			}

			// The sidecar's SIGTERM: it stops and deletes its socket.
			sidecar.Stop()
			if pod {
				e.StopEndpoint(d)
			}
			if err := os.Remove(e.SocketPath(d)); err != nil {
				t.Fatal(err)
			}
			if pod {
				e.StartEndpoint(d) // the driver's new pod
			}
			wait.For(t, registerTimeout, "registered through multireg", func() bool {
				return e.K.Registered(d.Name) && e.K.Counts(d.Name).Registrations == 2
			})
			if c := e.K.Counts(d.Name); c.Deregistrations != 1 {
				t.Errorf("kubelet's calls: %+v, want the sidecar's one deregistration only", c)
			}
			t.Logf("kubelet held no registration of %s for %s", d.Name, longestAbsence(e.K.EventsFor(d.Name)))
		})
	}
}

// Moving a driver back to a sidecar, either way round: the sidecar's start replaces multireg's
// socket (one deregistration); multireg leaves the sidecar's socket alone from then on, and when
// the driver leaves multireg's file the sidecar's socket stays and kubelet keeps the driver.
func TestMigrateBackToSidecar(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	d := driver{Name: "nfs.csi.example.com", Type: "CSIPlugin"}
	e.StartEndpoint(d)
	p := mrproc.Start(t, e.WriteConfig([]driver{d}))
	wait.For(t, registerTimeout, "registered through multireg", func() bool { return e.K.Registered(d.Name) })

	// node-driver-registrar's start: it removes what is at its path and listens there. Should
	// multireg publish its socket again in between (it sees its own removed), the listen fails
	// and the sidecar's container restarts, removing it again: the same, until it listens.
	wait.For(t, registerTimeout, "the sidecar to listen at its path", func() bool {
		if err := os.Remove(e.SocketPath(d)); err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
		r, err := plugins.ServeRegistrar(e.SocketPath(d), &registerapi.PluginInfo{
			Type: "CSIPlugin", Name: d.Name, Endpoint: e.EndpointPath(d), SupportedVersions: []string{"1.0.0"},
		})
		if err != nil {
			return false
		}
		t.Cleanup(r.Stop)
		return true
	})
	theirs := fileid.Of(e.SocketPath(d))
	wait.For(t, registerTimeout, "registered through the sidecar", func() bool {
		return e.K.Registered(d.Name) && e.K.Counts(d.Name).Registrations == 2
	})
	wait.For(t, registerTimeout, "multireg to wait behind the sidecar's socket", func() bool {
		return p.Count("registration failed", d.Name) > 0
	})
	e.WriteConfigContent(strings.Replace(e.ConfigContent(nil), "drivers:\n", "drivers: []\n", 1))
	wait.For(t, registerTimeout, "multireg to drop the driver", func() bool { return p.Count("config reloaded", "") > 0 })
	wait.Never(t, 2*time.Second, "the sidecar's socket or registration touched", func() bool {
		return fileid.Of(e.SocketPath(d)) != theirs || !e.K.Registered(d.Name) || e.K.Counts(d.Name).Deregistrations != 1
	})
}
