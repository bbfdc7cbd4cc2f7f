package kubelet_test

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/kubelet"
)

// Kubelet's reconciler passes once a second; a first registration takes 0–1 s after the socket
// appears, a retry after a failure waits 500 ms doubling. These bounds leave a wide margin for
// a loaded 2-core machine under -race.
const (
	registerTimeout = 10 * time.Second
	retryTimeout    = 20 * time.Second
)

func kinds(es []kubelet.Event) []kubelet.EventKind {
	var ks []kubelet.EventKind
	for _, e := range es {
		ks = append(ks, e.Kind)
	}
	return ks
}

func TestVersion(t *testing.T) {
	v := kubelet.Version()
	if !strings.HasPrefix(v, "v1.") {
		t.Fatalf("Version() = %q, want the k8s.io/kubernetes module version", v)
	}
	t.Logf("linked kubelet %s, retries register failures: %v", v, kubelet.RetriesRegisterFailures())
}

// TestRegisterEachType registers one plugin of each type, then removes each socket.
func TestRegisterEachType(t *testing.T) {
	t.Parallel()
	dir := shortDir(t)
	k := startKubelet(t, dir, kubelet.Options{})

	infos := []pluginInfo{
		{Type: registerapi.CSIPlugin, Name: "csi.example.com", Versions: []string{"1.0.0"}},
		{Type: registerapi.DRAPlugin, Name: "dra.example.com", Versions: []string{"v1.DRAPlugin", "v1beta1.DRAPlugin"}},
		{Type: registerapi.DevicePlugin, Name: "example.com/device", Versions: []string{"v1beta1"}},
	}
	var plugins []*testPlugin
	for i, info := range infos {
		info.Endpoint = filepath.Join(dir, strings.ToLower(info.Type)+".sock")
		listenEndpoint(t, info.Endpoint)
		reg := filepath.Join(k.Dir(), strings.ToLower(info.Type)+"-reg.sock")
		infos[i] = info
		plugins = append(plugins, servePlugin(t, reg, info))
	}

	for i, info := range infos {
		p := plugins[i]
		wait.For(t, registerTimeout, info.Name+" registered and notified", func() bool {
			return k.Registered(info.Name) && len(p.Statuses()) == 1
		})
		if got, want := p.Statuses(), []status{{Registered: true}}; !slices.Equal(got, want) {
			t.Errorf("%s: notified %+v, want %+v", info.Name, got, want)
		}
		es := k.EventsFor(info.Name)
		if got, want := kinds(es), []kubelet.EventKind{kubelet.EventValidate, kubelet.EventRegister}; !slices.Equal(got, want) {
			t.Fatalf("%s: events %v, want %v:%s", info.Name, got, want, kubelet.FormatEvents(es))
		}
		for _, e := range es {
			if e.Type != info.Type || e.Endpoint != info.Endpoint || !slices.Equal(e.Versions, info.Versions) {
				t.Errorf("%s: event %v, want type %s, endpoint %s, versions %v", info.Name, e, info.Type, info.Endpoint, info.Versions)
			}
		}
		if got := k.RegisteredEndpoints(info.Name); !slices.Equal(got, []string{info.Endpoint}) {
			t.Errorf("%s: endpoints %v, want [%s]", info.Name, got, info.Endpoint)
		}
	}
	want := []string{"csi.example.com", "dra.example.com", "example.com/device"}
	if got := k.RegisteredNames(); !slices.Equal(got, want) {
		t.Errorf("RegisteredNames() = %v, want %v", got, want)
	}

	for i, info := range infos {
		plugins[i].stop()
		wait.For(t, registerTimeout, info.Name+" deregistered", func() bool {
			return !k.Registered(info.Name)
		})
		es := k.EventsFor(info.Name)
		if last := es[len(es)-1]; last.Kind != kubelet.EventDeRegister || last.Endpoint != info.Endpoint {
			t.Errorf("%s: last event %v, want DeRegister of %s", info.Name, last, info.Endpoint)
		}
		if c := k.Counts(info.Name); c != (kubelet.Counts{Validations: 1, Registrations: 1, Deregistrations: 1}) {
			t.Errorf("%s: counts %+v", info.Name, c)
		}
	}
	if got := k.RegisteredNames(); len(got) != 0 {
		t.Errorf("RegisteredNames() = %v after every socket is gone", got)
	}
}

// TestRegisterFailure fails one RegisterPlugin call and never recreates the socket: kubelet
// 1.36 registers the plugin on its own retry, 1.35 leaves it failed until the socket is
// recreated.
func TestRegisterFailure(t *testing.T) {
	t.Parallel()
	dir := shortDir(t)
	k := startKubelet(t, dir, kubelet.Options{})
	const name = "fail.example.com"
	k.FailRegistrations(name, 1)
	info := pluginInfo{Type: registerapi.CSIPlugin, Name: name, Endpoint: filepath.Join(dir, "csi.sock"), Versions: []string{"1.0.0"}}
	listenEndpoint(t, info.Endpoint)
	reg := filepath.Join(k.Dir(), "fail-reg.sock")
	p := servePlugin(t, reg, info)

	wait.For(t, registerTimeout, "a failed registration, notified", func() bool {
		return k.Counts(name).RegistrationFailures == 1 && len(p.Statuses()) >= 1
	})
	if s := p.Statuses()[0]; s.Registered || !strings.Contains(s.Error, "injected registration failure") {
		t.Fatalf("first notification %+v, want the injected failure", s)
	}

	if kubelet.RetriesRegisterFailures() {
		wait.For(t, retryTimeout, "registered by kubelet's own retry", func() bool {
			return k.Registered(name) && len(p.Statuses()) == 2
		})
		if s := p.Statuses()[1]; !s.Registered {
			t.Errorf("second notification %+v, want registered", s)
		}
		want := []kubelet.EventKind{kubelet.EventValidate, kubelet.EventRegisterFailed, kubelet.EventValidate, kubelet.EventRegister}
		if es := k.EventsFor(name); !slices.Equal(kinds(es), want) {
			t.Errorf("events %v, want %v:%s", kinds(es), want, kubelet.FormatEvents(es))
		}
		return
	}

	// Kubelet 1.35 would have retried within 1+2+3 s; 6 s covers several of its attempts.
	wait.Never(t, 6*time.Second, "registered without a recreated socket", func() bool {
		return k.Registered(name) || k.Counts(name).Validations > 1
	})
	if got := p.Statuses(); len(got) != 1 {
		t.Errorf("notifications %+v, want only the failure", got)
	}

	// Recreating the socket is what makes 1.35 try again: it deregisters the failed plugin first.
	p.stop()
	p = servePlugin(t, reg, info)
	wait.For(t, retryTimeout, "registered after the socket was recreated", func() bool {
		return k.Registered(name) && len(p.Statuses()) == 1
	})
	want := []kubelet.EventKind{kubelet.EventValidate, kubelet.EventRegisterFailed, kubelet.EventDeRegister, kubelet.EventValidate, kubelet.EventRegister}
	if es := k.EventsFor(name); !slices.Equal(kinds(es), want) {
		t.Errorf("events %v, want %v:%s", kinds(es), want, kubelet.FormatEvents(es))
	}
}

// TestRestart stops the kubelet and starts a new one on the same directory: it registers the
// socket that is still there, and the plugin hears about it again.
func TestRestart(t *testing.T) {
	t.Parallel()
	dir := shortDir(t)
	k := startKubelet(t, dir, kubelet.Options{})
	const name = "restart.example.com"
	info := pluginInfo{Type: registerapi.DRAPlugin, Name: name, Endpoint: filepath.Join(dir, "dra.sock"), Versions: []string{"v1.DRAPlugin"}}
	listenEndpoint(t, info.Endpoint)
	p := servePlugin(t, filepath.Join(k.Dir(), "restart-reg.sock"), info)
	wait.For(t, registerTimeout, "registered", func() bool { return k.Registered(name) && len(p.Statuses()) == 1 })

	k.Stop()
	k2 := startKubelet(t, dir, kubelet.Options{})
	if k2.Registered(name) {
		t.Fatal("a new kubelet starts with the plugin registered")
	}
	wait.For(t, registerTimeout, "registered by the restarted kubelet", func() bool {
		return k2.Registered(name) && len(p.Statuses()) == 2
	})
	if got, want := p.Statuses(), []status{{Registered: true}, {Registered: true}}; !slices.Equal(got, want) {
		t.Errorf("notified %+v, want %+v", got, want)
	}
	if got, want := kinds(k2.EventsFor(name)), []kubelet.EventKind{kubelet.EventValidate, kubelet.EventRegister}; !slices.Equal(got, want) {
		t.Errorf("restarted kubelet's events %v, want %v", got, want)
	}
}

// TestValidationFailure covers what kubelet's handlers refuse: the plugin is told why.
func TestValidationFailure(t *testing.T) {
	t.Parallel()
	dir := shortDir(t)
	k := startKubelet(t, dir, kubelet.Options{})
	const oldDRA = "dra.example.com"
	infos := []pluginInfo{
		{Type: registerapi.CSIPlugin, Name: "csi2.example.com", Versions: []string{"2.0.0"}},
		{Type: registerapi.DRAPlugin, Name: oldDRA, Versions: []string{"v1alpha4"}},
		{Type: registerapi.DevicePlugin, Name: "nodomain", Versions: []string{"v1beta1"}},
		{Type: registerapi.DevicePlugin, Name: "example.com/old", Versions: []string{"v1alpha"}},
	}
	var plugins []*testPlugin
	for i, info := range infos {
		info.Endpoint = filepath.Join(dir, "ep.sock")
		plugins = append(plugins, servePlugin(t, filepath.Join(k.Dir(), string(rune('a'+i))+"-reg.sock"), info))
	}
	for i, info := range infos {
		p := plugins[i]
		if info.Name == oldDRA && kubelet.DRAFallsBackToAlpha() {
			// 1.33 accepts a DRA plugin whatever it lists; RegisterPlugin then fails on the
			// endpoint, which nothing serves.
			wait.For(t, registerTimeout, info.Name+" validated, then failed to register", func() bool {
				return k.Counts(info.Name).RegistrationFailures >= 1 && len(p.Statuses()) >= 1
			})
			if c := k.Counts(info.Name); c.ValidationFailures != 0 || c.Validations == 0 {
				t.Errorf("%s: kubelet %s refused v1alpha4 services:%s", info.Name, kubelet.Version(), kubelet.FormatEvents(k.EventsFor(info.Name)))
			}
			if s := p.Statuses()[0]; s.Registered || !strings.Contains(s.Error, "connect to endpoint") {
				t.Errorf("%s: notified %+v, want a failed connect", info.Name, s)
			}
			continue
		}
		wait.For(t, registerTimeout, info.Name+" refused", func() bool {
			return k.Counts(info.Name).ValidationFailures >= 1 && len(p.Statuses()) >= 1
		})
		if s := p.Statuses()[0]; s.Registered || !strings.Contains(s.Error, "validat") {
			t.Errorf("%s: notified %+v, want a validation failure", info.Name, s)
		}
		if k.Registered(info.Name) || k.Counts(info.Name).Registrations+k.Counts(info.Name).RegistrationFailures != 0 {
			t.Errorf("%s: RegisterPlugin called after a failed validation:%s", info.Name, kubelet.FormatEvents(k.EventsFor(info.Name)))
		}
	}
}

// TestEndpointCheck: an endpoint that accepts no connection fails RegisterPlugin, unless the
// check is off.
func TestEndpointCheck(t *testing.T) {
	t.Parallel()
	for _, skip := range []bool{false, true} {
		dir := shortDir(t)
		k := startKubelet(t, dir, kubelet.Options{SkipEndpointCheck: skip})
		const name = "example.com/nothing"
		p := servePlugin(t, filepath.Join(k.Dir(), "nothing-reg.sock"), pluginInfo{
			Type: registerapi.DevicePlugin, Name: name, Endpoint: filepath.Join(dir, "missing.sock"), Versions: []string{"v1beta1"},
		})
		if skip {
			wait.For(t, registerTimeout, "registered without a check", func() bool { return k.Registered(name) })
			continue
		}
		wait.For(t, registerTimeout, "a failed registration, notified", func() bool {
			return k.Counts(name).RegistrationFailures >= 1 && len(p.Statuses()) >= 1
		})
		if e := k.EventsFor(name)[1]; e.Kind != kubelet.EventRegisterFailed || !strings.Contains(e.Err, "connect to endpoint") {
			t.Errorf("event %v, want a failed connect", e)
		}
	}
}

// TestRegisterDelay: SetRegisterDelay holds RegisterPlugin, and Stop cuts a delay short.
func TestRegisterDelay(t *testing.T) {
	t.Parallel()
	dir := shortDir(t)
	k := startKubelet(t, dir, kubelet.Options{})
	const slow, stuck = "slow.example.com", "stuck.example.com"
	const delay = 1500 * time.Millisecond
	k.SetRegisterDelay(slow, delay)
	k.SetRegisterDelay(stuck, time.Hour)
	for _, name := range []string{slow, stuck} {
		info := pluginInfo{Type: registerapi.CSIPlugin, Name: name, Endpoint: filepath.Join(dir, name+".sock"), Versions: []string{"1.0.0"}}
		listenEndpoint(t, info.Endpoint)
		servePlugin(t, filepath.Join(k.Dir(), name+"-reg.sock"), info)
	}

	wait.For(t, registerTimeout+delay, slow+" registered", func() bool { return k.Registered(slow) })
	es := k.EventsFor(slow)
	if took := es[1].Time.Sub(es[0].Time); took < delay {
		t.Errorf("RegisterPlugin took %v, want at least %v:%s", took, delay, kubelet.FormatEvents(es))
	}

	wait.For(t, registerTimeout, stuck+" validated", func() bool { return k.Counts(stuck).Validations == 1 })
	start := time.Now()
	k.Stop()
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("Stop took %v with a RegisterPlugin delay of an hour in progress", took)
	}
	if k.Registered(stuck) {
		t.Errorf("%s registered", stuck)
	}
}

// TestNameKeys: DRA is keyed by (name, endpoint), so two instances register side by side; CSI
// is keyed by name, so a second socket for a registered driver fails validation until the first
// is gone.
func TestNameKeys(t *testing.T) {
	t.Parallel()
	dir := shortDir(t)
	k := startKubelet(t, dir, kubelet.Options{})

	const dra = "gpu.example.com"
	var instances []*testPlugin
	for _, n := range []string{"a", "b"} {
		info := pluginInfo{Type: registerapi.DRAPlugin, Name: dra, Endpoint: filepath.Join(dir, "dra-"+n+".sock"), Versions: []string{"v1beta1.DRAPlugin"}}
		listenEndpoint(t, info.Endpoint)
		instances = append(instances, servePlugin(t, filepath.Join(k.Dir(), "dra-"+n+"-reg.sock"), info))
	}
	wait.For(t, registerTimeout, "two DRA instances registered", func() bool { return len(k.RegisteredEndpoints(dra)) == 2 })
	instances[0].stop()
	wait.For(t, registerTimeout, "one DRA instance deregistered", func() bool { return len(k.RegisteredEndpoints(dra)) == 1 })
	if got, want := k.RegisteredEndpoints(dra), []string{filepath.Join(dir, "dra-b.sock")}; !slices.Equal(got, want) {
		t.Errorf("DRA endpoints %v, want %v", got, want)
	}

	const csi = "csi.example.com"
	first := pluginInfo{Type: registerapi.CSIPlugin, Name: csi, Endpoint: filepath.Join(dir, "csi-1.sock"), Versions: []string{"1.0.0"}}
	second := first
	second.Endpoint = filepath.Join(dir, "csi-2.sock")
	listenEndpoint(t, first.Endpoint)
	listenEndpoint(t, second.Endpoint)
	p1 := servePlugin(t, filepath.Join(k.Dir(), "csi-1-reg.sock"), first)
	wait.For(t, registerTimeout, "first CSI socket registered", func() bool { return k.Registered(csi) })
	p2 := servePlugin(t, filepath.Join(k.Dir(), "csi-2-reg.sock"), second)
	wait.For(t, registerTimeout, "second CSI socket refused", func() bool { return k.Counts(csi).ValidationFailures >= 1 })
	// The plugin manager notifies the plugin after the handler has refused it.
	wait.For(t, registerTimeout, "the refusal notified", func() bool { return len(p2.Statuses()) > 0 })
	if s := p2.Statuses(); len(s) == 0 || s[0].Registered || !strings.Contains(s[0].Error, "already registered") {
		t.Errorf("second socket notified %+v, want a validation failure", s)
	}
	p1.stop()
	wait.For(t, retryTimeout, "second CSI socket registered once the first is gone", func() bool {
		return slices.Equal(k.RegisteredEndpoints(csi), []string{second.Endpoint})
	})
}

// TestDevicePluginEndpoints: two sockets of one device plugin at two endpoints. Up to 1.36 the
// device manager keeps one client per resource: the second registration replaces the first,
// and removing either socket removes it. 1.37 keeps a client per endpoint, and removing a
// socket removes only its own.
func TestDevicePluginEndpoints(t *testing.T) {
	t.Parallel()
	dir := shortDir(t)
	k := startKubelet(t, dir, kubelet.Options{})
	const name = "example.com/gpu"
	var plugins []*testPlugin
	var endpoints []string
	for _, n := range []string{"a", "b"} {
		info := pluginInfo{Type: registerapi.DevicePlugin, Name: name, Endpoint: filepath.Join(dir, "dp-"+n+".sock"), Versions: []string{"v1beta1"}}
		listenEndpoint(t, info.Endpoint)
		plugins = append(plugins, servePlugin(t, filepath.Join(k.Dir(), "dp-"+n+"-reg.sock"), info))
		endpoints = append(endpoints, info.Endpoint)
		wait.For(t, registerTimeout, "instance "+n+" registered", func() bool { return k.Counts(name).Registrations == len(plugins) })
	}
	keyed := kubelet.DevicePluginsKeyedByEndpoint()
	want := endpoints[1:]
	if keyed {
		want = endpoints
	}
	if got := k.RegisteredEndpoints(name); !slices.Equal(got, want) {
		t.Errorf("kubelet %s: endpoints %v after two registrations, want %v", kubelet.Version(), got, want)
	}

	plugins[0].stop()
	wait.For(t, registerTimeout, "the first socket deregistered", func() bool { return k.Counts(name).Deregistrations == 1 })
	want = nil
	if keyed {
		want = endpoints[1:]
	}
	if got := k.RegisteredEndpoints(name); !slices.Equal(got, want) {
		t.Errorf("kubelet %s: endpoints %v once the first socket is gone, want %v:%s", kubelet.Version(), got, want, kubelet.FormatEvents(k.EventsFor(name)))
	}
}

func TestStartFails(t *testing.T) {
	dir := shortDir(t)
	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if k, err := kubelet.Start(t.Context(), filepath.Join(file, "registry"), kubelet.Options{}); err == nil {
		k.Stop()
		t.Fatal("Start under a regular file succeeded")
	}
}

// TestSocketReplacedBetweenLoops: a DRA plugin's socket renamed over its registered one
// between the two loops of a reconcile pass (HoldPass forces it) is registered before the old
// one is unregistered. The registration overwrites the old one's entry in kubelet's actual
// state, and the DRA manager refuses the (name, endpoint) it still holds. Kubelet 1.36 and
// later drop the failed entry: nothing ever deregisters the old registration, and kubelet's own
// retries are refused too. 1.35 and older keep the entry, so removing the socket deregisters
// the old registration.
func TestSocketReplacedBetweenLoops(t *testing.T) {
	t.Parallel()
	dir := shortDir(t)
	k := startKubelet(t, dir, kubelet.Options{})
	const name = "replaced.example.com"
	info := pluginInfo{Type: registerapi.DRAPlugin, Name: name, Endpoint: filepath.Join(dir, "dra.sock"), Versions: []string{"v1.DRAPlugin", "v1beta1.DRAPlugin"}}
	listenEndpoint(t, info.Endpoint)
	reg := filepath.Join(k.Dir(), "replaced-reg.sock")
	servePlugin(t, reg, info)
	wait.For(t, registerTimeout, "registered", func() bool { return k.Registered(name) })

	h := k.HoldPass(reg, 30*time.Second)
	select {
	case <-h.Holding():
	case <-time.After(registerTimeout):
		t.Fatal("no reconcile pass held")
	}
	p := replacePlugin(t, reg, info)
	if r := <-h.Result(); !r.Changed {
		t.Fatalf("the pass was held %v and went on without seeing the socket replaced", r.Held)
	}
	wait.For(t, registerTimeout, "the new socket refused", func() bool { return len(p.Statuses()) >= 1 })
	if s := p.Statuses()[0]; s.Registered || !strings.Contains(s.Error, "already registered for DRA driver plugin") {
		t.Fatalf("the new socket was told %+v, want the refusal of an endpoint already registered", s)
	}
	if c := k.Counts(name); c.Deregistrations != 0 || !slices.Equal(k.RegisteredEndpoints(name), []string{info.Endpoint}) {
		t.Fatalf("kubelet %+v, endpoints %v; want the old registration kept, never deregistered:%s", c, k.RegisteredEndpoints(name), kubelet.FormatEvents(k.EventsFor(name)))
	}

	if kubelet.RetriesRegisterFailures() {
		wait.For(t, retryTimeout, "kubelet's own retry, refused", func() bool { return len(p.Statuses()) >= 2 })
		if s := p.Statuses()[1]; s.Registered {
			t.Errorf("kubelet's retry was told %+v, want a refusal", s)
		}
		if r := k.StateReport(); !strings.Contains(r, "never deregistered") || strings.Contains(r, reg+":") {
			t.Errorf("state report, want the old registration marked and no entry for %s:\n%s", reg, r)
		}
		removePlugin(t, p) // nothing is left to deregister the old registration
		wait.Never(t, 3*time.Second, "the old registration deregistered", func() bool { return k.Counts(name).Deregistrations != 0 })
		return
	}
	removePlugin(t, p) // 1.35: the failed entry holds (name, endpoint), and its unregistration withdraws it
	wait.For(t, registerTimeout, "the old registration deregistered", func() bool { return !k.Registered(name) })
}
