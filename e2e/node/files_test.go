package node_test

import (
	"os"
	"syscall"
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

// fileID identifies a file: inode and change time (an inode number alone is often reused at
// once for a socket created anew).
type fileID struct {
	ino   uint64
	ctime syscall.Timespec
}

// ident returns path's fileID, the zero value if it does not exist.
func ident(path string) fileID {
	var st syscall.Stat_t
	if err := syscall.Lstat(path, &st); err != nil {
		return fileID{}
	}
	return fileID{st.Ino, st.Ctim}
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
