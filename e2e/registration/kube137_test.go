package registration

import (
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/kubelet"
	"multireg.dev/multireg/e2e/mrproc"
	"multireg.dev/multireg/e2e/plugins"
)

// What kubelet 1.37 changed, against each kubelet's real plugin manager; each test says what
// it expects of the kubelet linked in.

// TestDevicePluginRollingUpdate: a device plugin's new instance (dp.2) starts while the
// registered one (dp.1) runs, then dp.1 exits. A 1.37 kubelet's plugin manager (gRPC 1.82,
// which multireg reads from its user agent) gets dp.2 registered beside dp.1 and dp.1 withdrawn
// once it is gone: kubelet holds a registration of the resource throughout. An older one
// keeps dp.1 alone while it runs (its device manager would drop dp.2 when dp.1 exits), and
// gets dp.2 after.
func TestDevicePluginRollingUpdate(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	d := driver{Name: "example.com/rolling", Type: "DevicePlugin"}
	dir, old, p := e.startPattern(&d, "dp", "dp.*", "dp.1")
	e.startInstance(d, "dp.2")
	dp1, dp2 := filepath.Join(dir, "dp.1"), filepath.Join(dir, "dp.2")
	if kubelet.DevicePluginsKeyedByEndpoint() {
		e.registeredAt(d, dp1, dp2)
		wait.Never(t, 2*time.Second, "dp.1's registration withdrawn while it runs", func() bool {
			return len(e.K.RegisteredEndpoints(d.Name)) != 2
		})
	} else {
		wait.Never(t, 2*time.Second, "a move while dp.1 runs", func() bool {
			return !slices.Equal(e.K.RegisteredEndpoints(d.Name), []string{dp1})
		})
	}
	old.Stop()
	e.registeredAt(d, dp2)
	gap := longestAbsence(e.K.EventsFor(d.Name))
	c := e.K.Counts(d.Name)
	if kubelet.DevicePluginsKeyedByEndpoint() {
		if gap != 0 {
			t.Errorf("kubelet %s held no registration of %s for %s, want never", kubelet.Version(), d.Name, gap)
		}
		if c.Registrations != 2 || c.Deregistrations != 1 || c.RegistrationFailures != 0 {
			t.Errorf("kubelet's calls: %+v, want 2 registrations, 1 deregistration, no failure", c)
		}
		if n := p.Count("driver endpoint moved; registering the new instance beside the old one", d.Name); n != 1 {
			t.Errorf("the hand-over logged %d times, want once", n)
		}
	} else if c.Registrations != 2 {
		t.Errorf("kubelet's calls: %+v, want 2 registrations", c)
	}
	t.Logf("kubelet %s: no registration of %s for %s during the rolling update", kubelet.Version(), d.Name, gap)
}

// TestDRAHealthAdvertised: a DRA driver registered with the default versions is advertised
// with the DRAResourceHealth service its endpoint serves (kubelet 1.37 watches health only
// then), however late within multireg's probe it answers, and without one when it serves none.
// Every kubelet accepts the lists.
func TestDRAHealthAdvertised(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	with := driver{Name: "health.example.com", Type: "DRAPlugin"}
	slow := driver{Name: "slowhealth.example.com", Type: "DRAPlugin"} // v1's Unimplemented comes after a second
	without := driver{Name: "nohealth.example.com", Type: "DRAPlugin"}
	ep, err := plugins.StartDRAHealth(e.EndpointPath(with), with.Name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ep.Stop)
	slowEP, err := plugins.StartDRAHealthSlow(e.EndpointPath(slow), slow.Name, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(slowEP.Stop)
	e.StartEndpoint(without)
	p := mrproc.Start(t, e.WriteConfig([]driver{with, slow, without}))
	wait.For(t, registerTimeout, "all registered", func() bool {
		return e.K.Registered(with.Name) && e.K.Registered(slow.Name) && e.K.Registered(without.Name)
	})
	versions := func(name string) []string {
		for _, ev := range e.K.EventsFor(name) {
			if ev.Kind == kubelet.EventRegister {
				return ev.Versions
			}
		}
		return nil
	}
	for _, d := range []driver{with, slow} {
		if got, want := versions(d.Name), []string{"v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth"}; !slices.Equal(got, want) {
			t.Errorf("kubelet %s was told %q for %s, want %q", kubelet.Version(), got, d.Name, want)
		}
	}
	if got, want := versions(without.Name), []string{"v1.DRAPlugin", "v1beta1.DRAPlugin"}; !slices.Equal(got, want) {
		t.Errorf("kubelet %s was told %q for %s, want %q", kubelet.Version(), got, without.Name, want)
	}
	for _, d := range []driver{with, slow} {
		if n := p.Count("device health services the DRA driver serves, advertised to kubelet", d.Name); n != 1 {
			t.Errorf("the health service found for %s logged %d times, want once", d.Name, n)
		}
	}
}

// TestSelfRegisteredDevicePluginRefused: a device plugin whose endpoint is in kubelet's
// device-plugin directory (where plugins that Register on kubelet.sock keep their sockets) is
// never registered: kubelet sees nothing of it, multireg's status and /readyz say why, and the
// other drivers are registered as usual.
func TestSelfRegisteredDevicePluginRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	other := driver{Name: "example.com/other", Type: "DevicePlugin"}
	self := driver{Name: "example.com/selfreg", Type: "DevicePlugin", Endpoint: "/var/lib/kubelet/device-plugins/selfreg.sock"}
	local := filepath.Join(e.Dir, "ep", "selfreg.sock") // the plugin's socket as multireg sees it
	self.Extra = "    localEndpoint: " + local + "\n"
	ep, err := plugins.Start(local, self.Type, self.Name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ep.Stop)
	e.StartEndpoint(other)
	p := mrproc.Start(t, e.WriteConfig([]driver{other, self}))
	wait.For(t, registerTimeout, other.Name+" registered", func() bool { return e.K.Registered(other.Name) })
	wait.For(t, registerTimeout, "the refusal in /status", func() bool {
		for _, st := range p.Status(t).Drivers {
			if st.Name == self.Name {
				return st.Phase == "BackingOff" && strings.Contains(st.LastError, "kubelet's device-plugin directory")
			}
		}
		return false
	})
	wait.Never(t, 2*time.Second, "kubelet to see "+self.Name, func() bool { return len(e.K.EventsFor(self.Name)) > 0 })
	code, body, err := p.Get(t, "/readyz")
	if err != nil || code != 503 || !strings.Contains(body, self.Name) {
		t.Errorf("/readyz: %d %q (%v), want 503 naming %s", code, body, err, self.Name)
	}
	if n := p.Count("driver not registered", self.Name); n != 1 {
		t.Errorf("the refusal logged %d times, want once", n)
	}
}
