package registrar

import (
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/testkit"
)

// TestAbsentDriverIsReady: a driver whose endpoint is not on this node is absent, and ready
// unless required; Update changes required without touching the loop. A file at the endpoint
// makes it present, and not ready until registered; its removal makes it absent again, also
// while the loop backs off.
func TestAbsentDriverIsReady(t *testing.T) {
	s, d := setupWaiting(t, config.DevicePlugin, nil)
	testkit.Eventually(t, 5*time.Second, "the driver to be seen absent", func() bool {
		st := statusOf(s, d.Name)
		return st.Absent && st.Phase == WaitingForEndpoint
	})
	if st := statusOf(s, d.Name); !st.Ready() {
		t.Errorf("an absent driver that is not required is not ready: %+v", st)
	}
	attempts := statusOf(s, d.Name).Attempts

	d.Required = true
	s.Update(d)
	if st := statusOf(s, d.Name); !st.Required || st.Ready() {
		t.Errorf("an absent required driver: required %v, ready %v; want required and not ready", st.Required, st.Ready())
	}
	d.Required = false
	s.Update(d)

	// Present, but not answering (nothing listens): the driver runs here and is not ready.
	if err := os.MkdirAll(filepath.Dir(d.LocalEndpoint), 0o750); err != nil {
		t.Fatal(err)
	}
	deadSocket(t, d.LocalEndpoint)
	testkit.Eventually(t, 5*time.Second, "the endpoint to be seen present", func() bool {
		return !statusOf(s, d.Name).Absent
	})
	if st := statusOf(s, d.Name); st.Ready() {
		t.Errorf("a present, unregistered driver is ready: %+v", st)
	}
	if err := os.Remove(d.LocalEndpoint); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 5*time.Second, "the endpoint's removal to be seen", func() bool {
		return statusOf(s, d.Name).Absent
	})
	if st := statusOf(s, d.Name); st.Attempts != attempts || !st.Ready() {
		t.Errorf("attempts %d (want %d: nothing published), ready %v", st.Attempts, attempts, st.Ready())
	}
}

// TestReadyWhenRegistered: a registered driver is ready, required or not, also once its
// endpoint is gone (the registration stays).
func TestReadyWhenRegistered(t *testing.T) {
	s, d, ep := setup(t, config.DevicePlugin, func(d *config.Driver) { d.Required = true })
	awaitSocket(t, d)
	registerAndWait(t, s, d)
	if st := statusOf(s, d.Name); !st.Ready() || st.Absent {
		t.Errorf("registered: ready %v, absent %v", st.Ready(), st.Absent)
	}
	ep.Stop()
	testkit.Eventually(t, 5*time.Second, "the endpoint's removal to be seen", func() bool {
		return statusOf(s, d.Name).Absent
	})
	if st := statusOf(s, d.Name); !st.Ready() || st.Phase != Registered {
		t.Errorf("registered, endpoint gone: phase %s, ready %v; want Registered and ready", st.Phase, st.Ready())
	}
}

// TestAbsentWhileBackingOff: a driver kubelet rejected backs off for a minute; removed from
// the node meanwhile, it is absent at once, not after the backoff.
func TestAbsentWhileBackingOff(t *testing.T) {
	s, d, e := setup(t, config.DevicePlugin, func(d *config.Driver) {
		d.Backoff.InitialInterval, d.Backoff.MaxInterval = time.Minute, time.Minute
	})
	awaitSocket(t, d)
	register(t, d.SocketPath, false, "no room")
	testkit.Eventually(t, 5*time.Second, "BackingOff", func() bool { return statusOf(s, d.Name).Phase == BackingOff })
	if st := statusOf(s, d.Name); st.Absent || st.Ready() {
		t.Fatalf("a present, rejected driver: absent %v, ready %v", st.Absent, st.Ready())
	}
	e.Stop()
	testkit.Eventually(t, 5*time.Second, "the driver absent while it backs off", func() bool {
		st := statusOf(s, d.Name)
		return st.Phase == BackingOff && st.Absent && st.Ready()
	})
}

// TestTransitionsLoggedByName: a JSON log names a transition's states and event, as a text log
// does, not by number.
func TestTransitionsLoggedByName(t *testing.T) {
	var b strings.Builder
	log := slog.New(slog.NewJSONHandler(&b, nil))
	log.Info("transition", "from", stRegistered, "event", evRejected, "to", stBackingOff)
	if want := `"from":"Registered","event":"Rejected","to":"BackingOff"`; !strings.Contains(b.String(), want) {
		t.Errorf("JSON log %s, want %s", b.String(), want)
	}
}
