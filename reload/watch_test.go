package reload

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"multireg.dev/multireg/internal/testkit"
)

// waitCalls waits for n applier calls in all (they may arrive over several polls) and returns
// them; more than n fails the test.
func waitCalls(t *testing.T, rec *recorder, n int, what string) []string {
	t.Helper()
	var got []string
	testkit.Eventually(t, 5*time.Second, what, func() bool {
		got = append(got, rec.take()...)
		return len(got) >= n
	})
	if len(got) != n {
		t.Fatalf("%s: calls %q, want %d", what, got, n)
	}
	return got
}

// quiet checks for a while that nothing more is applied.
func quiet(t *testing.T, rec *recorder, d time.Duration) {
	t.Helper()
	testkit.Never(t, d, "applied again", func() bool {
		got := rec.take()
		if len(got) != 0 {
			t.Logf("applied: %q", got)
		}
		return len(got) != 0
	})
}

// watchesInPlace waits for the read the watcher asks for once its watches are in place (it
// finds the file unchanged): an edit before it would be seen by that read, not by the watch.
func watchesInPlace(t *testing.T, s *started) {
	t.Helper()
	testkit.Eventually(t, 5*time.Second, "the read once the watches are in place", func() bool {
		st := s.r.State()
		return st.LastReloadTime.After(st.LastSuccessTime)
	})
}

// TestWatchSeesEveryKindOfUpdate changes the file in each way it changes on a node, and
// expects each change applied exactly once.
func TestWatchSeesEveryKindOfUpdate(t *testing.T) {
	s := start(t, drivers("/run/v0.sock"), Options{})
	defer s.stop()
	waitCalls(t, s.rec, 1, "initial start")
	dir := filepath.Dir(s.path)

	updates := []struct {
		name  string
		write func(content string)
	}{
		{"write in place", func(c string) {
			f, err := os.OpenFile(s.path, os.O_WRONLY|os.O_TRUNC, 0)
			if err != nil {
				t.Fatal(err)
			}
			f.WriteString(c)
			f.Close()
		}},
		{"rename over (editors, mv)", func(c string) {
			tmp := filepath.Join(dir, ".drivers.yaml.swp")
			write(t, tmp, c)
			if err := os.Rename(tmp, s.path); err != nil {
				t.Fatal(err)
			}
		}},
		{"delete then create", func(c string) {
			if err := os.Remove(s.path); err != nil {
				t.Fatal(err)
			}
			write(t, s.path, c)
		}},
	}
	for i, u := range updates {
		u.write(drivers("/run/v" + string(rune('1'+i)) + ".sock"))
		waitCalls(t, s.rec, 2, u.name+" applied as one restart")
		quiet(t, s.rec, 500*time.Millisecond)
	}
}

// TestWatchConfigMapSwap updates the file the way kubelet updates a ConfigMap volume: the
// data goes into a new timestamped directory, and the `..data` symlink is swapped with a
// rename; config.yaml is a symlink through `..data`.
func TestWatchConfigMapSwap(t *testing.T) {
	dir := t.TempDir()
	writeVersion := func(v, content string) {
		if err := os.Mkdir(filepath.Join(dir, v), 0o755); err != nil {
			t.Fatal(err)
		}
		write(t, filepath.Join(dir, v, "config.yaml"), content)
	}
	writeVersion("..2026_11_21_v1", drivers("/run/v1.sock"))
	if err := os.Symlink("..2026_11_21_v1", filepath.Join(dir, "..data")); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "config.yaml")
	if err := os.Symlink("..data/config.yaml", path); err != nil {
		t.Fatal(err)
	}

	s := startAt(t, path, Options{})
	defer s.stop()
	waitCalls(t, s.rec, 1, "initial start")

	// kubelet's AtomicWriter: new directory, ..data_tmp symlink, rename over ..data, remove
	// the old directory.
	writeVersion("..2026_11_21_v2", drivers("/run/v2.sock"))
	if err := os.Symlink("..2026_11_21_v2", filepath.Join(dir, "..data_tmp")); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(dir, "..data_tmp"), filepath.Join(dir, "..data")); err != nil {
		t.Fatal(err)
	}
	if err := os.RemoveAll(filepath.Join(dir, "..2026_11_21_v1")); err != nil {
		t.Fatal(err)
	}
	got := waitCalls(t, s.rec, 2, "the swap applied as one restart")
	if want := "start d0.csi.example.com /run/v2.sock"; got[1] != want {
		t.Errorf("calls %q, want a restart with the new endpoint", got)
	}
	quiet(t, s.rec, 500*time.Millisecond)
}

// TestWatchSurvivesDirectoryRecreation: the config directory deleted and created again is
// watched again; so is the directory of a symlink's target, though nothing happens in the
// directory of the symlink itself.
func TestWatchSurvivesDirectoryRecreation(t *testing.T) {
	for _, symlinked := range []bool{false, true} {
		t.Run(fmt.Sprintf("symlinked=%v", symlinked), func(t *testing.T) {
			root := t.TempDir()
			dir := filepath.Join(root, "cfg")
			if err := os.Mkdir(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			file := filepath.Join(dir, "drivers.yaml")
			write(t, file, drivers("/run/v1.sock"))
			path := file
			if symlinked {
				if err := os.Mkdir(filepath.Join(root, "link"), 0o755); err != nil {
					t.Fatal(err)
				}
				path = filepath.Join(root, "link", "drivers.yaml")
				if err := os.Symlink(file, path); err != nil {
					t.Fatal(err)
				}
			}
			s := startAt(t, path, Options{Resync: time.Hour})
			defer s.stop()
			waitCalls(t, s.rec, 1, "initial start")

			if err := os.RemoveAll(dir); err != nil {
				t.Fatal(err)
			}
			testkit.Eventually(t, 5*time.Second, "the missing file reported", func() bool { return !s.r.State().LastReloadSuccessful })
			if err := os.Mkdir(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			write(t, file, drivers("/run/v2.sock"))
			waitCalls(t, s.rec, 2, "the new file applied")
			// And the new directory is watched: a further change is seen without a resync.
			write(t, file, drivers("/run/v3.sock"))
			waitCalls(t, s.rec, 2, "a change in the new directory applied")
		})
	}
}

// TestWatchSymlinkTarget: the config path is a symlink to a file in another directory. An
// edit of the target in place is seen without waiting for the resync, also after the symlink
// is pointed into a third directory; the old target's directory is no longer watched.
func TestWatchSymlinkTarget(t *testing.T) {
	root := t.TempDir()
	for _, d := range []string{"cfg", "a", "b"} {
		if err := os.Mkdir(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	target := func(dir string) string { return filepath.Join(root, dir, "drivers.yaml") }
	write(t, target("a"), drivers("/run/v1.sock"))
	path := filepath.Join(root, "cfg", "drivers.yaml")
	if err := os.Symlink(target("a"), path); err != nil {
		t.Fatal(err)
	}
	s := startAt(t, path, Options{Resync: time.Hour})
	defer s.stop()
	waitCalls(t, s.rec, 1, "initial start")
	watchesInPlace(t, s)

	write(t, target("a"), drivers("/run/v2.sock"))
	waitCalls(t, s.rec, 2, "an edit of the target in place applied")

	// Re-point the symlink atomically, as `ln -s` to a temporary name and `mv -T` do.
	write(t, target("b"), drivers("/run/v3.sock"))
	tmp := filepath.Join(root, "cfg", ".drivers.yaml.tmp")
	if err := os.Symlink(target("b"), tmp); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
	waitCalls(t, s.rec, 2, "the re-pointed symlink applied")
	write(t, target("b"), drivers("/run/v4.sock"))
	waitCalls(t, s.rec, 2, "an edit of the new target in place applied")
	quiet(t, s.rec, 500*time.Millisecond)

	read := s.r.State().LastReloadTime
	write(t, target("a"), drivers("/run/v5.sock"))
	quiet(t, s.rec, 500*time.Millisecond)
	if st := s.r.State(); !st.LastReloadTime.Equal(read) {
		t.Errorf("an edit in the old target's directory made the file be read again (at %s, after %s)", st.LastReloadTime, read)
	}
}

// TestWatchSymlinkChainMovedByKick: the config path leads to its file through a symlink in a
// directory that is not watched, so re-pointing that symlink raises no event. A kick (SIGHUP)
// reads the new target and moves the watch there: its next edit in place is seen.
func TestWatchSymlinkChainMovedByKick(t *testing.T) {
	root := t.TempDir()
	for _, d := range []string{"cfg", "hop", "a", "b"} {
		if err := os.Mkdir(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	target := func(dir string) string { return filepath.Join(root, dir, "drivers.yaml") }
	hop := filepath.Join(root, "hop", "drivers.yaml")
	write(t, target("a"), drivers("/run/v1.sock"))
	if err := os.Symlink(target("a"), hop); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(root, "cfg", "drivers.yaml")
	if err := os.Symlink(hop, path); err != nil {
		t.Fatal(err)
	}
	s := startAt(t, path, Options{Resync: time.Hour})
	defer s.stop()
	waitCalls(t, s.rec, 1, "initial start")
	watchesInPlace(t, s)

	write(t, target("b"), drivers("/run/v2.sock"))
	if err := os.Remove(hop); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target("b"), hop); err != nil {
		t.Fatal(err)
	}
	s.r.Kick()
	waitCalls(t, s.rec, 2, "the new target applied on a kick")
	write(t, target("b"), drivers("/run/v3.sock"))
	waitCalls(t, s.rec, 2, "an edit of the new target in place applied")
}
