package reload

import (
	"os"
	"path/filepath"
	"testing"
	"time"
)

func eventually(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		<-tick.C
	}
}

// waitCalls waits for n applier calls in all (they may arrive over several polls) and returns
// them; more than n fails the test.
func waitCalls(t *testing.T, rec *recorder, n int, what string) []string {
	t.Helper()
	var got []string
	eventually(t, 5*time.Second, what, func() bool {
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
	end := time.NewTimer(d)
	defer end.Stop()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-end.C:
			return
		case <-tick.C:
			if got := rec.take(); len(got) != 0 {
				t.Fatalf("applied again: %q", got)
			}
		}
	}
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
// watched again.
func TestWatchSurvivesDirectoryRecreation(t *testing.T) {
	root := t.TempDir()
	dir := filepath.Join(root, "cfg")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "drivers.yaml")
	write(t, path, drivers("/run/v1.sock"))
	s := startAt(t, path, Options{})
	defer s.stop()
	waitCalls(t, s.rec, 1, "initial start")

	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "the missing file reported", func() bool { return !s.r.State().LastReloadSuccessful })
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	write(t, path, drivers("/run/v2.sock"))
	waitCalls(t, s.rec, 2, "the new file applied")
	// And the new directory is watched: a further change is seen without a resync.
	write(t, path, drivers("/run/v3.sock"))
	waitCalls(t, s.rec, 2, "a change in the new directory applied")
}
