package agent

import (
	"testing"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/nodecond"
)

var t0 = time.Date(2026, 11, 29, 8, 0, 0, 0, time.UTC)

// TestCSINodeGrace: a CSI driver kubelet accepted is a warning (NotListed) once CSINode has
// not listed it for two reconcile passes, not before; notListedAt says when that will be.
func TestCSINodeGrace(t *testing.T) {
	csi := nodecond.Driver{Name: "nfs.csi.k8s.io", Type: config.CSIPlugin, Phase: "Registered", Required: true, Since: t0, EndpointUp: true}
	in := nodecond.Input{Drivers: []nodecond.Driver{csi}, CSINode: nodecond.CSINode{Known: true}, Now: t0.Add(time.Second)}
	if e := nodecond.Evaluate(in).Evidence[0]; e.NotListed || e.Held {
		t.Errorf("a second after registration: %+v, want not held and no warning yet", e)
	}
	at := notListedAt(nodecond.Evaluate(in), in)
	if want := t0.Add(nodecond.CSINodeGrace); at.Before(want) || at.After(want.Add(10*time.Millisecond)) {
		t.Errorf("the warning is due at %s, want %s", at, want)
	}
	in.Now = at
	if e := nodecond.Evaluate(in).Evidence[0]; !e.NotListed {
		t.Errorf("at %s: %+v, want a warning", at, e)
	}
	in.CSINode.Drivers = map[string]time.Time{csi.Name: at}
	if e := nodecond.Evaluate(in).Evidence[0]; e.NotListed || !e.Held {
		t.Errorf("listed: %+v, want held", e)
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
