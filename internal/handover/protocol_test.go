package handover

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/testkit"
)

// A file's identity survives the hand-over message unchanged, on 64-bit and 32-bit platforms
// alike (a Timespec's fields are 32-bit on linux/arm).
func TestWireIDRoundTrip(t *testing.T) {
	path := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	id, _, err := fsid.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	b, err := json.Marshal(idWire(id))
	if err != nil {
		t.Fatal(err)
	}
	var w wireID
	if err := json.Unmarshal(b, &w); err != nil {
		t.Fatal(err)
	}
	if got := w.id(); got != id {
		t.Errorf("identity after the wire = %+v; want %+v (message %s)", got, id, b)
	}
}

// A holder's hand-over socket goes with it: Close removes it, unless another instance's socket
// was published over it meanwhile, which stays.
func TestListenerCloseRemovesItsOwnSocket(t *testing.T) {
	dir := testkit.ShortDir(t)
	path := filepath.Join(dir, Name)
	l, err := Listen(dir)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(path); !os.IsNotExist(err) {
		t.Fatalf("%s after Close: %v, want none", Name, err)
	}

	old, err := Listen(dir)
	if err != nil {
		t.Fatal(err)
	}
	next, err := Listen(dir) // the next instance's, renamed over the old one's
	if err != nil {
		t.Fatal(err)
	}
	defer next.Close()
	if err := old.Close(); err != nil {
		t.Fatal(err)
	}
	if id, _, err := fsid.Stat(path); err != nil || id != next.id {
		t.Fatalf("%s after the old listener's Close: %v, want the next instance's socket", Name, err)
	}
}
