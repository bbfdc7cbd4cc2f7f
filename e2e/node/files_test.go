package node_test

import (
	"os"
	"testing"
)

// Files on the node: the drivers file, registration sockets and the test's directories.

// writeFileAtomic replaces path with content by a rename, as editors and config management do.
func writeFileAtomic(t *testing.T, path, content string) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// tempDir is a new directory below the cluster's, which goes with it even if this binary
// dies (unlike t.TempDir's).
func tempDir(t *testing.T) string {
	t.Helper()
	d, err := os.MkdirTemp(cl.Dir(), "test.")
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// sockets maps each driver to the registration socket multireg reported for it in /status.
var sockets = map[string]string{}

func socketOf(t *testing.T, name string) string {
	t.Helper()
	p, ok := sockets[name]
	if !ok {
		t.Fatalf("no registration socket known for %s: it was never seen Registered", name)
	}
	return p
}
