package handover

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"multireg.dev/multireg/internal/fsid"
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
