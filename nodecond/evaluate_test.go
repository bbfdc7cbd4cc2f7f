package nodecond

import (
	"strings"
	"testing"
	"time"

	"multireg.dev/multireg/config"
)

var t0 = time.Date(2026, 11, 29, 8, 0, 0, 0, time.UTC)

func registered(name, typ string) Driver {
	return Driver{Name: name, Type: typ, Phase: phaseRegistered, Required: true, Since: t0, EndpointUp: true}
}

func devices(n int) *int { return &n }

// TestEvaluate: each type's test of what kubelet holds, and what decides the condition: only
// required drivers, each missing one named with why, in a stable message (no time that moves).
func TestEvaluate(t *testing.T) {
	csi, dra, dev := registered("nfs.csi.k8s.io", config.CSIPlugin), registered("gpu.example.com", config.DRAPlugin), registered("example.com/gpu", config.DevicePlugin)
	dev.Devices = devices(2)
	listed := CSINode{Known: true, Drivers: map[string]time.Time{csi.Name: t0}}
	all := Input{Drivers: []Driver{csi, dra, dev}, CSINode: listed, PodResources: true, Answers: true, Now: t0.Add(time.Minute)}

	type check struct {
		name    string
		in      func(in Input) Input
		held    bool
		reason  string
		message string // a part of it
	}
	with := func(i int, f func(*Driver)) func(Input) Input {
		return func(in Input) Input {
			in.Drivers = append([]Driver(nil), in.Drivers...)
			f(&in.Drivers[i])
			return in
		}
	}
	for _, c := range []check{
		{"every required plugin held", func(in Input) Input { return in }, true, ReasonRegistered, "kubelet holds every required plugin (3)"},
		{"CSI: not in CSINode", func(in Input) Input { in.CSINode = CSINode{Known: true}; return in }, false, ReasonMissing,
			"1 of 3 required plugins not held by kubelet: nfs.csi.k8s.io (CSIPlugin): registered since 2026-11-29T08:00:00Z, not listed in the node's CSINode"},
		{"CSI: CSINode not read", func(in Input) Input { in.CSINode = CSINode{}; return in }, false, ReasonMissing, "the node's CSINode not read yet"},
		{"CSI: rejected", with(0, func(d *Driver) {
			d.Phase, d.LastError = phaseBackingOff, "kubelet rejected the registration: no"
		}), false, ReasonMissing, "nfs.csi.k8s.io (CSIPlugin): not registered: kubelet rejected the registration: no"},
		{"CSI: rejected, then serving the next attempt", with(0, func(d *Driver) {
			d.Phase, d.Since, d.LastError = phaseServing, t0.Add(time.Hour), "kubelet rejected the registration: no"
		}), false, ReasonMissing, "nfs.csi.k8s.io (CSIPlugin): not registered: kubelet rejected the registration: no"},
		{"DRA: endpoint absent", with(1, func(d *Driver) {
			d.Phase, d.Absent = phaseWaiting, true
		}), false, ReasonMissing, "gpu.example.com (DRAPlugin): no endpoint on this node since 2026-11-29T08:00:00Z"},
		{"DRA: registered, its endpoint gone", with(1, func(d *Driver) {
			d.Absent, d.EndpointUp, d.EndpointSince = true, false, t0.Add(time.Second)
		}), false, ReasonMissing, "gpu.example.com (DRAPlugin): registered, and its endpoint is gone since 2026-11-29T08:00:01Z"},
		{"DRA: awaiting the verdict", with(1, func(d *Driver) { d.Phase = phaseServing }), false, ReasonMissing, "waiting for kubelet's verdict since"},
		{"device plugin: no devices", with(2, func(d *Driver) { d.Devices = devices(0) }), false, ReasonMissing,
			"example.com/gpu (DevicePlugin): registered, and kubelet holds no allocatable device of its resource"},
		{"device plugin: pod-resources down", func(in Input) Input { in.Answers = false; return in }, false, ReasonMissing, "kubelet's pod-resources API does not answer"},
		{"device plugin: pod-resources not read", func(in Input) Input {
			in.PodResources, in.Answers = false, false
			in.Drivers = append([]Driver(nil), in.Drivers...)
			in.Drivers[2].Devices = nil
			return in
		}, true, ReasonRegistered, ""},
		{"not required: never decides", with(0, func(d *Driver) {
			d.Phase, d.Required = phaseBackingOff, false
		}), true, ReasonRegistered, "kubelet holds every required plugin (2)"},
		{"none required", func(in Input) Input {
			in.Drivers = []Driver{{Name: "x", Type: config.DRAPlugin, Phase: phaseBackingOff}}
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

// TestMessageBounded: a message names as many missing drivers as fit in maxMessage, each
// with its reason cut to maxWhy, and counts the rest; it is cut on a rune boundary.
func TestMessageBounded(t *testing.T) {
	var ds []Driver
	for i := range 40 {
		d := registered("driver-"+strings.Repeat("x", 20)+string(rune('a'+i%26))+string(rune('a'+i/26)), config.DRAPlugin)
		d.Phase, d.LastError = phaseBackingOff, strings.Repeat("é", 300)
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
