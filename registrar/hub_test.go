package registrar

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/sockfile"
	"multireg.dev/multireg/internal/testkit"
)

// TestPublishThatCannotServeKeepsTheSocket: a new generation that cannot be served (here the
// hub has stopped) fails before its socket is renamed onto the path: the socket kubelet holds
// stays, and nothing else is left behind.
func TestPublishThatCannotServeKeepsTheSocket(t *testing.T) {
	dir := testkit.ShortDir(t)
	spec := handoverDrivers(t, dir)[1] // the device plugin
	l := bareLoop(t, spec)
	cur, err := l.socks.publish(spec.SocketPath, nil, l.ep.at, l.ep.versions())
	if err != nil {
		t.Fatal(err)
	}
	defer cur.stop()
	l.env.hub.Close()
	if _, err := l.socks.publish(l.socks.publishPath(cur, nil, l.socks.swapsPaths(l.ro != nil), l.socks.rollsOver(l.ro != nil)), cur, l.ep.at, l.ep.versions()); err == nil || !strings.Contains(err.Error(), "stopping") {
		t.Fatalf("publish with the hub stopped: %v, want the error that says so", err)
	}
	if id, _, err := fsid.Stat(cur.path); err != nil || id != cur.id {
		t.Errorf("the registered socket was replaced or removed: %v, %v (was %v)", id, err, cur.id)
	}
	entries, err := os.ReadDir(filepath.Dir(cur.path))
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if sockfile.IsTempName(e.Name()) {
			t.Errorf("a temporary socket is left: %s", e.Name())
		}
	}
}
