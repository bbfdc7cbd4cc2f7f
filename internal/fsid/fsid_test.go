package fsid

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"testing"
)

// TestIDTellsARecreatedFile: a file removed and created again at its path has another ID,
// also when the kernel hands it the same inode; a rename keeps its Key (not its ID: a rename
// changes the change time).
func TestIDTellsARecreatedFile(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "f")
	if err := os.WriteFile(p, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	first, mode, err := Stat(p)
	if err != nil || mode != 0 {
		t.Fatalf("Stat: %v, mode %v", err, mode)
	}
	moved := filepath.Join(dir, "g")
	if err := os.Rename(p, moved); err != nil {
		t.Fatal(err)
	}
	if k, err := KeyAt(moved); err != nil || k != first.Key() {
		t.Errorf("KeyAt after the rename: %v, %v; want %v", k, err, first.Key())
	}
	first, _, _ = Stat(moved)
	for range 50 { // the kernel often reuses the inode just freed
		os.Remove(moved)
		if err := os.WriteFile(moved, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		id, _, err := Stat(moved)
		if err != nil {
			t.Fatal(err)
		}
		if id == first {
			t.Fatalf("a file created anew has the old one's ID %v", id)
		}
		first = id
	}
	if _, _, err := Stat(p); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Stat of a missing file: %v", err)
	}
	if k, err := KeyAt(p); err != nil || k != (Key{}) {
		t.Errorf("KeyAt of a missing file: %v, %v; want the zero key", k, err)
	}
}

// TestStatDoesNotFollowSymlinks: Stat names the link; KeyAt the file it points to.
func TestStatDoesNotFollowSymlinks(t *testing.T) {
	dir := t.TempDir()
	target, link := filepath.Join(dir, "t"), filepath.Join(dir, "l")
	if err := os.WriteFile(target, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
	tid, _, _ := Stat(target)
	lid, mode, err := Stat(link)
	if err != nil || mode != fs.ModeSymlink || lid == tid {
		t.Errorf("Stat(link): %v, %v, mode %v; want the link's own identity", lid, err, mode)
	}
	if k, _ := KeyAt(link); k != tid.Key() {
		t.Errorf("KeyAt(link) = %v, want the target's %v", k, tid.Key())
	}
}
