package regdir

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"multireg.dev/multireg/internal/testkit"
)

func TestRemoveOrphans(t *testing.T) {
	dir := testkit.ShortDir(t)
	stale := func(name string) {
		l, err := testkit.ListenUnlinked(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		l.Close() // the file stays, nothing listens
	}
	stale("gone-reg.sock")                                                   // recorded, no longer configured: removed
	stale("kept-reg.sock")                                                   // recorded and configured: stays (it will be renamed over)
	stale("foreign-reg.sock")                                                // never recorded: not ours, stays
	live, err := testkit.ListenUnlinked(filepath.Join(dir, "live-reg.sock")) // recorded, but someone serves it: stays
	if err != nil {
		t.Fatal(err)
	}
	defer live.Close()
	if err := os.WriteFile(filepath.Join(dir, "file-reg.sock"), []byte("x"), 0o644); err != nil { // recorded, not a socket: stays
		t.Fatal(err)
	}
	if err := recordOwned(dir, []string{"kept-reg.sock", "gone-reg.sock", "live-reg.sock", "file-reg.sock"}); err != nil {
		t.Fatal(err)
	}
	removed, err := removeOrphans(dir, []string{"kept-reg.sock"}, testkit.Logger(t))
	if err != nil {
		t.Fatal(err)
	}
	if want := filepath.Join(dir, "gone-reg.sock"); len(removed) != 1 || removed[0] != want {
		t.Errorf("removed %q, want only %s", removed, want)
	}
	for _, name := range []string{"kept-reg.sock", "foreign-reg.sock", "live-reg.sock", "file-reg.sock"} {
		if _, err := os.Lstat(filepath.Join(dir, name)); err != nil {
			t.Errorf("%s: %v, want it left alone", name, err)
		}
	}
	// No record at all (a first run): nothing to do.
	if removed, err := removeOrphans(testkit.ShortDir(t), nil, testkit.Logger(t)); err != nil || len(removed) != 0 {
		t.Errorf("without a record: %q, %v", removed, err)
	}
}

// TestRemoveOrphansSumsUpMany: the sockets of drivers no longer configured are removed with a
// line for each when they are few, and one line for all when they are many.
func TestRemoveOrphansSumsUpMany(t *testing.T) {
	for _, n := range []int{perSocketLines, perSocketLines + 1, 500} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			dir := testkit.ShortDir(t)
			var names []string
			for i := range n {
				name := fmt.Sprintf("gone-%d-reg.sock", i)
				l, err := testkit.ListenUnlinked(filepath.Join(dir, name))
				if err != nil {
					t.Fatal(err)
				}
				l.Close() // the file stays, nothing listens
				names = append(names, name)
			}
			if err := recordOwned(dir, names); err != nil {
				t.Fatal(err)
			}
			var logs testkit.Buffer
			removed, err := removeOrphans(dir, nil, logs.Logger())
			if err != nil || len(removed) != n {
				t.Fatalf("removed %d sockets (%v), want %d", len(removed), err, n)
			}
			lines := strings.Count(logs.String(), "\n")
			switch {
			case n <= perSocketLines && lines != n:
				t.Errorf("%d sockets: %d log lines, want one for each:\n%s", n, lines, logs.String())
			case n > perSocketLines && (lines != 1 || !strings.Contains(logs.String(), fmt.Sprintf("sockets=%d ", n))):
				t.Errorf("%d sockets: %d log lines, want one that counts them:\n%s", n, lines, logs.String())
			}
		})
	}
}
