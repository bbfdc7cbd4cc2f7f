package registration

import (
	"context"
	"errors"
	"os"
	"os/exec"
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
// then), and without one when it serves none. Every kubelet accepts both lists.
func TestDRAHealthAdvertised(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	with := driver{Name: "health.example.com", Type: "DRAPlugin"}
	without := driver{Name: "nohealth.example.com", Type: "DRAPlugin"}
	ep, err := plugins.StartDRAHealth(e.EndpointPath(with), with.Name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ep.Stop)
	e.StartEndpoint(without)
	p := mrproc.Start(t, e.WriteConfig([]driver{with, without}))
	wait.For(t, registerTimeout, "both registered", func() bool { return e.K.Registered(with.Name) && e.K.Registered(without.Name) })
	versions := func(name string) []string {
		for _, ev := range e.K.EventsFor(name) {
			if ev.Kind == kubelet.EventRegister {
				return ev.Versions
			}
		}
		return nil
	}
	if got, want := versions(with.Name), []string{"v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth"}; !slices.Equal(got, want) {
		t.Errorf("kubelet %s was told %q for %s, want %q", kubelet.Version(), got, with.Name, want)
	}
	if got, want := versions(without.Name), []string{"v1.DRAPlugin", "v1beta1.DRAPlugin"}; !slices.Equal(got, want) {
		t.Errorf("kubelet %s was told %q for %s, want %q", kubelet.Version(), got, without.Name, want)
	}
	if n := p.Count("device health services the DRA driver serves, advertised to kubelet", with.Name); n != 1 {
		t.Errorf("the health service found logged %d times, want once", n)
	}
}

// TestSelfRegisteredDevicePluginRefused: a drivers file that lists a device plugin whose
// endpoint is in kubelet's device-plugin directory (where plugins that Register on kubelet.sock
// keep their sockets) is invalid, whatever else it lists: multireg validate and multireg run
// at start refuse it alike (exit 1), and a reload to it changes nothing: the drivers
// registered stay, and kubelet sees nothing of the plugin.
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
	bad := e.ConfigContent([]driver{other, self})
	badFile := filepath.Join(e.Dir, "bad.yaml")
	if err := os.WriteFile(badFile, []byte(bad), 0o644); err != nil {
		t.Fatal(err)
	}
	want := badFile + `: drivers[1].endpoint: "` + self.Endpoint + `": is in kubelet's device-plugin directory /var/lib/kubelet/device-plugins, `
	vout, code := mrproc.Run(t, "validate", "--config", badFile)
	line, _, _ := strings.Cut(vout, "\n")
	if code != 1 || !strings.HasPrefix(line, want) || strings.Count(vout, "\n") != 1 {
		t.Errorf("multireg validate: exit %d, %q; want exit 1 and one line starting %q", code, vout, want)
	}
	// Bounded, should it start: refused, it exits at once.
	bin, err := mrproc.Binary()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), registerTimeout)
	out, err := exec.CommandContext(ctx, bin, "run", "--config", badFile, "--http-endpoint", "").CombinedOutput()
	cancel()
	if code := exitCode(err); code != 1 || !strings.Contains(string(out), line+"\n") {
		t.Errorf("multireg run: exit %d (%v), %q; want exit 1 and validate's line %q", code, err, out, line)
	}

	p := mrproc.Start(t, e.WriteConfig([]driver{other}))
	wait.For(t, registerTimeout, other.Name+" registered", func() bool { return e.K.Registered(other.Name) && registeredIn(p, []driver{other}) })
	events := len(e.K.Events())
	e.WriteConfigContent(bad)
	wait.For(t, registerTimeout, "the reload refused in /status", func() bool {
		c := p.Status(t).Config
		return !c.LastReloadSuccessful && strings.Contains(c.LastReloadError, strings.TrimPrefix(line, badFile+": "))
	})
	wait.Never(t, 2*time.Second, "kubelet to see a change", func() bool { return len(e.K.Events()) != events })
	if _, listed := p.Status(t).Driver(self.Name); listed {
		t.Errorf("%s is among multireg's drivers", self.Name)
	}
	if code, body, err := p.Get(t, "/readyz"); err != nil || code != 200 {
		t.Errorf("/readyz: %d %q (%v), want 200: the last good file's drivers are registered", code, body, err)
	}
	if n := p.Count("config not applied; the last good one stays in force", ""); n != 1 {
		t.Errorf("the refused reload logged %d times, want once", n)
	}
}

// exitCode is the exit code of a command that ended with err: -1 when it did not exit.
func exitCode(err error) int {
	if exit, ok := errors.AsType[*exec.ExitError](err); ok {
		return exit.ExitCode()
	}
	if err != nil {
		return -1
	}
	return 0
}
