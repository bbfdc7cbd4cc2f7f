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

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/kubelet"
	"multireg.dev/multireg/e2e/mrproc"
	"multireg.dev/multireg/e2e/plugins"
)

// What kubelet 1.37 changed, against each kubelet's real plugin manager; each test says what
// it expects of the kubelet linked in.

// TestDevicePluginRollingUpdate: a device plugin's new instance (dp.2) starts while the
// registered one (dp.1) runs, then dp.1 exits. multireg registers dp.2 beside dp.1, withdraws
// dp.1's registration once it is gone, and reads kubelet's pod-resources API to see what
// kubelet did. A 1.37 kubelet's device manager keeps the resource's devices throughout. An
// older one (one client per resource name) drops them when dp.1's registration goes: multireg
// registers dp.2 again at once, and the next move (dp.3) is registered in place of dp.2's
// registration as soon as dp.3 answers. A bystander's GetInfo on another driver's socket, with
// a newer or an older gRPC in its user agent, changes none of it.
func TestDevicePluginRollingUpdate(t *testing.T) {
	for _, bystander := range []string{"", "grpc-go/1.85.0", "grpc-go/1.60.0"} {
		name := "alone"
		if bystander != "" {
			name = "bystander " + bystander
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			devicePluginRollingUpdate(t, bystander)
		})
	}
}

func devicePluginRollingUpdate(t *testing.T, bystander string) {
	e := newEnv(t)
	d := driver{Name: "example.com/rolling", Type: "DevicePlugin", Endpoint: filepath.Join(e.Dir, "ep", "dp", "dp.*")}
	other := driver{Name: "other.csi.example.com", Type: "CSIPlugin"}
	dir := filepath.Dir(d.Endpoint)
	old := e.startInstance(d, "dp.1")
	e.StartEndpoint(other)
	p := mrproc.Start(t, e.WriteConfig([]driver{d, other}))
	dp1, dp2, dp3 := filepath.Join(dir, "dp.1"), filepath.Join(dir, "dp.2"), filepath.Join(dir, "dp.3")
	e.registeredAt(d, dp1)
	wait.For(t, registerTimeout, other.Name+" registered", func() bool { return e.K.Registered(other.Name) })
	if bystander != "" {
		getInfoAs(t, e.SocketPath(other), bystander)
	}

	second := e.startInstance(d, "dp.2")
	if kubelet.DevicePluginsKeyedByEndpoint() {
		e.registeredAt(d, dp1, dp2)
		wait.Never(t, 2*time.Second, "dp.1's registration withdrawn while it runs", func() bool {
			return len(e.K.RegisteredEndpoints(d.Name)) != 2
		})
	} else {
		e.registeredAt(d, dp2) // beside dp.1: this device manager replaced dp.1's client
	}
	old.Stop()
	wait.For(t, registerTimeout, "dp.1's registration withdrawn", func() bool { return e.K.Counts(d.Name).Deregistrations > 0 })
	if !kubelet.DevicePluginsKeyedByEndpoint() {
		// This device manager dropped the resource with dp.1's registration: dp.2 is
		// registered again.
		wait.For(t, registerTimeout, "dp.2 registered again", func() bool { return e.K.Counts(d.Name).Registrations == 3 })
	}
	e.registeredAt(d, dp2)
	wait.For(t, registerTimeout, "kubelet holds the resource's devices", func() bool { return e.K.AllocatableDevices(d.Name) > 0 })
	gap := longestAbsence(e.K.EventsFor(d.Name))
	c := e.K.Counts(d.Name)
	if n := p.Count("driver endpoint moved; registering the new instance beside the old one", d.Name); n != 1 {
		t.Errorf("the move beside the old instance logged %d times, want once", n)
	}
	if kubelet.DevicePluginsKeyedByEndpoint() {
		if gap != 0 {
			t.Errorf("kubelet %s held no registration of %s for %s, want never", kubelet.Version(), d.Name, gap)
		}
		if c.Registrations != 2 || c.Deregistrations != 1 || c.RegistrationFailures != 0 {
			t.Errorf("kubelet's calls: %+v, want 2 registrations, 1 deregistration, no failure", c)
		}
		wait.For(t, registerTimeout, "the move verified in kubelet's view", func() bool {
			return p.Count("kubelet kept the resource's devices through the move", d.Name) == 1
		})
		if n := p.Count("kubelet dropped the resource's devices when the old instance's registration went: registering the new instance again", d.Name); n != 0 {
			t.Errorf("a drop seen %d times on a kubelet that keeps the devices", n)
		}
		t.Logf("kubelet %s: no registration of %s for %s during the rolling update", kubelet.Version(), d.Name, gap)
		return
	}
	if c.Registrations != 3 {
		t.Errorf("kubelet's calls: %+v, want 3 registrations (dp.1, dp.2 beside it, dp.2 again)", c)
	}
	if n := p.Count("kubelet dropped the resource's devices when the old instance's registration went: registering the new instance again", d.Name); n != 1 {
		t.Errorf("the drop logged %d times, want once", n)
	}
	t.Logf("kubelet %s: the first move, registered beside: no registration of %s for %s", kubelet.Version(), d.Name, gap)

	// Learned: the next new instance is registered in place of dp.2's registration as soon as
	// it answers, in the other path: kubelet deregisters dp.2 and registers dp.3 in one pass.
	before := len(e.K.EventsFor(d.Name))
	e.startInstance(d, "dp.3")
	e.registeredAt(d, dp3)
	wait.For(t, registerTimeout, "kubelet holds the resource's devices", func() bool { return e.K.AllocatableDevices(d.Name) > 0 })
	second.Stop()
	wait.Never(t, 2*time.Second, "a registration again once dp.2 exited", func() bool {
		return !slices.Equal(e.K.RegisteredEndpoints(d.Name), []string{dp3}) || e.K.AllocatableDevices(d.Name) == 0
	})
	t.Logf("kubelet %s: the second move, in place of the old registration: no registration of %s for %s", kubelet.Version(), d.Name,
		longestAbsence(e.K.EventsFor(d.Name)[before:]))
	if n := p.Count("driver endpoint moved; registering the new instance beside the old one", d.Name); n != 1 {
		t.Errorf("the move beside the old instance logged %d times, want once: the second move goes after", n)
	}
}

// getInfoAs calls GetInfo on a registration socket as a local client whose gRPC user agent
// starts with agent would: a probe, grpcurl, another registrar.
func getInfoAs(t *testing.T, socket, agent string) {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithUserAgent(agent))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := registerapi.NewRegistrationClient(conn).GetInfo(ctx, &registerapi.InfoRequest{}); err != nil {
		t.Fatalf("GetInfo as %s: %v", agent, err)
	}
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
