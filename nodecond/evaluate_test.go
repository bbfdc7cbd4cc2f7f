//go:build linux

package nodecond

import (
	"strings"
	"testing"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/registrar"
)

var t0 = time.Date(2026, 11, 29, 8, 0, 0, 0, time.UTC)

func registered(name, typ string) registrar.DriverStatus {
	return registrar.DriverStatus{Name: name, Type: typ, Phase: registrar.Registered, Required: true, Since: t0, EndpointUp: true}
}

// TestEvaluate: each type's test of what kubelet holds, and what decides the condition: only
// required drivers, each missing one named with why, in a stable message (no time that moves).
func TestEvaluate(t *testing.T) {
	csi, dra, dev := registered("nfs.csi.k8s.io", config.CSIPlugin), registered("gpu.example.com", config.DRAPlugin), registered("example.com/gpu", config.DevicePlugin)
	dev.Kubelet = &registrar.KubeletView{Devices: 2}
	listed := CSINode{Known: true, Drivers: map[string]time.Time{csi.Name: t0}}
	all := Input{Drivers: []registrar.DriverStatus{csi, dra, dev}, CSINode: listed, PodResources: true, Answers: true, Now: t0.Add(time.Minute)}

	type check struct {
		name    string
		in      func(in Input) Input
		held    bool
		reason  string
		message string // a part of it
	}
	with := func(i int, f func(*registrar.DriverStatus)) func(Input) Input {
		return func(in Input) Input {
			in.Drivers = append([]registrar.DriverStatus(nil), in.Drivers...)
			f(&in.Drivers[i])
			return in
		}
	}
	for _, c := range []check{
		{"every required plugin held", func(in Input) Input { return in }, true, ReasonRegistered, "kubelet holds every required plugin (3)"},
		{"CSI: not in CSINode", func(in Input) Input { in.CSINode = CSINode{Known: true}; return in }, false, ReasonMissing,
			"1 of 3 required plugins not held by kubelet: nfs.csi.k8s.io (CSIPlugin): registered since 2026-11-29T08:00:00Z, not listed in the node's CSINode"},
		{"CSI: CSINode not read", func(in Input) Input { in.CSINode = CSINode{}; return in }, false, ReasonMissing, "the node's CSINode not read yet"},
		{"CSI: rejected", with(0, func(d *registrar.DriverStatus) {
			d.Phase, d.LastError = registrar.BackingOff, "kubelet rejected the registration: no"
		}), false, ReasonMissing, "nfs.csi.k8s.io (CSIPlugin): not registered: kubelet rejected the registration: no"},
		{"CSI: rejected, then serving the next attempt", with(0, func(d *registrar.DriverStatus) {
			d.Phase, d.Since, d.LastError = registrar.Serving, t0.Add(time.Hour), "kubelet rejected the registration: no"
		}), false, ReasonMissing, "nfs.csi.k8s.io (CSIPlugin): not registered: kubelet rejected the registration: no"},
		{"DRA: endpoint absent", with(1, func(d *registrar.DriverStatus) {
			d.Phase, d.Absent = registrar.WaitingForEndpoint, true
		}), false, ReasonMissing, "gpu.example.com (DRAPlugin): no endpoint on this node since 2026-11-29T08:00:00Z"},
		{"DRA: registered, its endpoint gone", with(1, func(d *registrar.DriverStatus) {
			d.Absent, d.EndpointUp, d.EndpointSince = true, false, t0.Add(time.Second)
		}), false, ReasonMissing, "gpu.example.com (DRAPlugin): registered, and its endpoint is gone since 2026-11-29T08:00:01Z"},
		{"DRA: awaiting the verdict", with(1, func(d *registrar.DriverStatus) { d.Phase = registrar.Serving }), false, ReasonMissing, "waiting for kubelet's verdict since"},
		{"device plugin: no devices", with(2, func(d *registrar.DriverStatus) { d.Kubelet = &registrar.KubeletView{} }), false, ReasonMissing,
			"example.com/gpu (DevicePlugin): registered, and kubelet holds no allocatable device of its resource"},
		{"device plugin: pod-resources down", func(in Input) Input { in.Answers = false; return in }, false, ReasonMissing, "kubelet's pod-resources API does not answer"},
		{"device plugin: pod-resources not read", func(in Input) Input {
			in.PodResources, in.Answers = false, false
			in.Drivers = append([]registrar.DriverStatus(nil), in.Drivers...)
			in.Drivers[2].Kubelet = nil
			return in
		}, true, ReasonRegistered, ""},
		{"not required: never decides", with(0, func(d *registrar.DriverStatus) {
			d.Phase, d.Required = registrar.BackingOff, false
		}), true, ReasonRegistered, "kubelet holds every required plugin (2)"},
		{"none required", func(in Input) Input {
			in.Drivers = []registrar.DriverStatus{{Name: "x", Type: config.DRAPlugin, Phase: registrar.BackingOff}}
			return in
		}, true, ReasonNoneRequired, "no driver of multireg's drivers file is required"},
	} {
		t.Run(c.name, func(t *testing.T) {
			in := c.in(all)
			v := Evaluate(in)
			if v.True != c.held || v.Reason != c.reason || !strings.Contains(v.Message, c.message) {
				t.Errorf("Evaluate: %v %s %q; want %v %s, a message with %q", v.True, v.Reason, v.Message, c.held, c.reason, c.message)
			}
			if len(v.Evidence) != len(in.Drivers) {
				t.Errorf("evidence of %d drivers, want %d", len(v.Evidence), len(in.Drivers))
			}
			// The same input, later: the same message (it is written only when it changes).
			in.Now = in.Now.Add(time.Hour)
			if again := Evaluate(in); again.Message != v.Message {
				t.Errorf("an hour later the message is %q, was %q", again.Message, v.Message)
			}
		})
	}
}

// TestCSINodeGrace: a CSI driver kubelet accepted is a warning (NotListed) once CSINode has
// not listed it for two reconcile passes, not before; notListedAt says when that will be.
func TestCSINodeGrace(t *testing.T) {
	csi := registered("nfs.csi.k8s.io", config.CSIPlugin)
	in := Input{Drivers: []registrar.DriverStatus{csi}, CSINode: CSINode{Known: true}, Now: t0.Add(time.Second)}
	if e := Evaluate(in).Evidence[0]; e.NotListed || e.Held {
		t.Errorf("a second after registration: %+v, want not held and no warning yet", e)
	}
	at := notListedAt(Evaluate(in), in)
	if want := t0.Add(CSINodeGrace); at.Before(want) || at.After(want.Add(10*time.Millisecond)) {
		t.Errorf("the warning is due at %s, want %s", at, want)
	}
	in.Now = at
	if e := Evaluate(in).Evidence[0]; !e.NotListed {
		t.Errorf("at %s: %+v, want a warning", at, e)
	}
	in.CSINode.Drivers = map[string]time.Time{csi.Name: at}
	if e := Evaluate(in).Evidence[0]; e.NotListed || !e.Held {
		t.Errorf("listed: %+v, want held", e)
	}
}

// TestMessageBounded: a message names as many missing drivers as fit in maxMessage, each
// with its reason cut to maxWhy, and counts the rest; it is cut on a rune boundary.
func TestMessageBounded(t *testing.T) {
	var ds []registrar.DriverStatus
	for i := range 40 {
		d := registered("driver-"+strings.Repeat("x", 20)+string(rune('a'+i%26))+string(rune('a'+i/26)), config.DRAPlugin)
		d.Phase, d.LastError = registrar.BackingOff, strings.Repeat("é", 300)
		ds = append(ds, d)
	}
	v := Evaluate(Input{Drivers: ds})
	if len(v.Message) > maxMessage {
		t.Errorf("message of %d bytes, want at most %d", len(v.Message), maxMessage)
	}
	if !strings.Contains(v.Message, " more") || !strings.HasPrefix(v.Message, "40 of 40 required plugins") {
		t.Errorf("message %q: want the count and the rest counted", v.Message)
	}
	if !strings.Contains(v.Message, "…") || strings.ContainsRune(v.Message, '\uFFFD') {
		t.Errorf("message %q: want each reason cut on a rune boundary", v.Message)
	}
}

// TestLimiter: writeBurst writes at once, then one each writeEvery (jittered by ±20%).
func TestLimiter(t *testing.T) {
	var l limiter
	l.tokens = writeBurst
	now := t0
	for i := range writeBurst {
		if ok, _ := l.allow(now); !ok {
			t.Fatalf("write %d of the burst refused", i+1)
		}
	}
	ok, wait := l.allow(now)
	if ok || wait < writeEvery*8/10 || wait > writeEvery*12/10 {
		t.Fatalf("after the burst: %v, wait %s; want a refusal and a wait of about %s", ok, wait, writeEvery)
	}
	now = now.Add(writeEvery)
	if ok, _ := l.allow(now); !ok {
		t.Errorf("a write %s later refused", writeEvery)
	}
	// Over an hour of constant changes: at most burst + 3600/30 writes.
	writes := 0
	for s := range 3600 {
		if ok, _ := l.allow(now.Add(time.Duration(s) * time.Second)); ok {
			writes++
		}
	}
	if max := writeBurst + int(time.Hour/writeEvery); writes > max {
		t.Errorf("%d writes in an hour of changes, want at most %d", writes, max)
	}
}

func TestParseTaint(t *testing.T) {
	for s, want := range map[string]string{
		"multireg.dev/plugins-not-ready:NoSchedule":      "multireg.dev/plugins-not-ready:NoSchedule",
		"ebs.csi.aws.com/agent-not-ready=true:NoExecute": "ebs.csi.aws.com/agent-not-ready=true:NoExecute",
	} {
		tt, err := ParseTaint(s)
		if err != nil || tt.String() != want {
			t.Errorf("ParseTaint(%q) = %v, %v; want %s", s, tt, err, want)
		}
	}
	for s, want := range map[string]string{
		"no-effect":           "want KEY[=VALUE]:EFFECT",
		"k:Sometimes":         `effect "Sometimes": must be NoSchedule, PreferNoSchedule or NoExecute`,
		"bad key!:NoSchedule": `key "bad key!"`,
		"k=v v:NoSchedule":    `value "v v"`,
	} {
		if _, err := ParseTaint(s); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ParseTaint(%q): %v, want an error with %q", s, err, want)
		}
	}
	if !(Taint{Key: "k", Effect: "NoSchedule"}).Matches(Taint{Key: "k", Value: "x", Effect: "NoSchedule"}) ||
		(Taint{Key: "k", Value: "y", Effect: "NoSchedule"}).Matches(Taint{Key: "k", Value: "x", Effect: "NoSchedule"}) ||
		(Taint{Key: "k", Effect: "NoSchedule"}).Matches(Taint{Key: "k", Effect: "NoExecute"}) {
		t.Error("Matches: a taint without a value matches any value, one with a value only its own, and the effect always")
	}
}

func TestCheckConditionType(t *testing.T) {
	if err := CheckConditionType("multireg.dev/PluginsRegistered"); err != nil {
		t.Error(err)
	}
	for _, bad := range []string{"PluginsRegistered", "Ready", "multireg.dev/", "a b/c"} {
		if err := CheckConditionType(bad); err == nil {
			t.Errorf("CheckConditionType(%q) accepted", bad)
		}
	}
}
