package fswatch

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"multireg.dev/multireg/internal/testkit"
)

// testWatcher returns a watcher that dispatches events until the test ends.
func testWatcher(t *testing.T) *Watcher {
	t.Helper()
	w, err := New(testkit.Logger(t))
	if err != nil {
		t.Fatal(err)
	}
	testkit.RunUntilEnd(t, w.Run)
	return w
}

// subscribe subscribes to path on w until the test ends.
func subscribe(t *testing.T, w *Watcher, path string) *Subscription {
	s := w.Subscribe(path)
	t.Cleanup(s.Close)
	return s
}

// changes waits until s has reported every bit of want, and returns all that it reported.
// Bits print as dirGone|lost|changed|created.
func changes(t *testing.T, s *Subscription, want Change) Change {
	t.Helper()
	var got Change
	defer func() {
		if t.Failed() {
			t.Logf("the subscription reported %04b", got)
		}
	}()
	testkit.Eventually(t, 5*time.Second, fmt.Sprintf("the subscription to report %04b", want), func() bool {
		select {
		case <-s.c:
			got |= s.Take()
		default:
		}
		return got&want == want
	})
	return got
}

// renameInto creates a file at path in one step, as a rename into place: a single event.
func renameInto(t *testing.T, path string) {
	t.Helper()
	tmp := filepath.Join(testkit.ShortDir(t), "tmp")
	if err := os.WriteFile(tmp, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// TestSubscriptionReportsWhatHappened: a creation, a change of attributes and a removal are
// told apart; a chmod is no creation (a driver's chmod of its socket is no restart).
func TestSubscriptionReportsWhatHappened(t *testing.T) {
	dir := testkit.ShortDir(t)
	path := filepath.Join(dir, "f")
	s := subscribe(t, testWatcher(t), path)
	if got := s.Take(); got != 0 {
		t.Errorf("reported %04b before anything happened", got)
	}
	renameInto(t, path)
	if got := changes(t, s, Created); got != Created {
		t.Errorf("a file renamed into place: %04b, want only created", got)
	}
	if err := os.Chmod(path, 0o644); err != nil {
		t.Fatal(err)
	}
	if got := changes(t, s, Changed); got&Created != 0 {
		t.Errorf("a chmod: %04b, reported as a creation", got)
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if got := changes(t, s, Changed); got&Created != 0 {
		t.Errorf("a removal: %04b, reported as a creation", got)
	}
}

// TestSubscriptionFollowsItsDirectory: the file's directory moved away is reported; its parent
// is watched for it meanwhile; when it is back the subscription watches it again, says that
// events may have been lost, and reports the file's creation.
func TestSubscriptionFollowsItsDirectory(t *testing.T) {
	dir := testkit.ShortDir(t)
	reg := filepath.Join(dir, "reg")
	if err := os.Mkdir(reg, 0o750); err != nil {
		t.Fatal(err)
	}
	w := testWatcher(t)
	s := subscribe(t, w, filepath.Join(reg, "f"))
	if !w.Watches(reg, "f") {
		t.Fatal("the file's directory is not watched")
	}
	if err := os.Rename(reg, reg+".old"); err != nil {
		t.Fatal(err)
	}
	changes(t, s, DirGone)
	if !w.Watches(dir, "reg") {
		t.Error("the parent is not watched for the missing directory")
	}
	if err := os.Mkdir(reg, 0o750); err != nil {
		t.Fatal(err)
	}
	changes(t, s, Lost)
	if !w.Watches(reg, "f") {
		t.Error("the directory is not watched again")
	}
	renameInto(t, filepath.Join(reg, "f"))
	changes(t, s, Created)
}

// TestSubscriptionDescendsAsDirectoriesAppear: while directories on the way to the file are
// missing, the nearest existing one is watched; each creation moves the watch one level down,
// and the file's creation is reported.
func TestSubscriptionDescendsAsDirectoriesAppear(t *testing.T) {
	dir := testkit.ShortDir(t)
	a, b := filepath.Join(dir, "a"), filepath.Join(dir, "a", "b")
	w := testWatcher(t)
	s := subscribe(t, w, filepath.Join(b, "f"))
	if !w.Watches(dir, "a") {
		t.Fatal("no watch for a/")
	}
	for _, level := range []struct{ dir, watched, name string }{{a, a, "b"}, {b, b, "f"}} {
		if err := os.Mkdir(level.dir, 0o755); err != nil {
			t.Fatal(err)
		}
		changes(t, s, Lost)
		if !w.Watches(level.watched, level.name) {
			t.Fatalf("after %s appeared: no watch in it for %s", level.dir, level.name)
		}
	}
	w.mu.Lock()
	_, upper := w.dirs[dir]
	w.mu.Unlock()
	if upper {
		t.Error("the top directory is still watched once the file's is")
	}
	renameInto(t, filepath.Join(b, "f"))
	changes(t, s, Created)
}

// TestSubscriptionPollsAtTheWatchLimit: where inotify refuses every watch, the file is looked
// at every PollInterval and what the look finds is reported; once inotify allows a watch
// again, the directory is watched and events may have been lost.
func TestSubscriptionPollsAtTheWatchLimit(t *testing.T) {
	if !testkit.AtWatchLimit(t, 0) {
		return
	}
	dir := testkit.ShortDir(t)
	path := filepath.Join(dir, "f")
	w := testWatcher(t)
	s := subscribe(t, w, path)
	if w.Watches(dir, "f") {
		t.Fatal("a watch beyond the limit")
	}
	renameInto(t, path)
	changes(t, s, Created)
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	changes(t, s, Changed)

	if err := os.WriteFile("/proc/sys/user/max_inotify_watches", []byte("100"), 0); err != nil {
		t.Fatal(err)
	}
	changes(t, s, Lost)
	if !w.Watches(dir, "f") {
		t.Error("the directory is not watched once inotify allows it")
	}
}

// TestSubscriptionMatching: a subscription to a pattern is woken for the files whose names
// match, and for no other file of the directory; while inotify refuses the watch, a look tells
// the matching files apart the same way.
func TestSubscriptionMatching(t *testing.T) {
	dir := testkit.ShortDir(t)
	s := testWatcher(t).SubscribeMatching(filepath.Join(dir, "dp.*"))
	t.Cleanup(s.Close)
	renameInto(t, filepath.Join(dir, "other"))
	testkit.Never(t, 200*time.Millisecond, "a wake-up for a name that does not match", func() bool {
		select {
		case <-s.c:
			return s.Take() != 0
		default:
			return false
		}
	})
	renameInto(t, filepath.Join(dir, "dp.1"))
	changes(t, s, Created)
	if err := os.Remove(filepath.Join(dir, "dp.1")); err != nil {
		t.Fatal(err)
	}
	changes(t, s, Changed)
}

func TestSubscriptionMatchingPollsAtTheWatchLimit(t *testing.T) {
	if !testkit.AtWatchLimit(t, 0) {
		return
	}
	dir := testkit.ShortDir(t)
	s := testWatcher(t).SubscribeMatching(filepath.Join(dir, "dp.*"))
	t.Cleanup(s.Close)
	renameInto(t, filepath.Join(dir, "other"))
	renameInto(t, filepath.Join(dir, "dp.1"))
	changes(t, s, Created)
	if err := os.Remove(filepath.Join(dir, "dp.1")); err != nil {
		t.Fatal(err)
	}
	changes(t, s, Changed)
}

// TestOneWarningAtTheWatchLimit: however many paths inotify refuses, one warning names the
// limit, and one info line says when every path is watched again.
func TestOneWarningAtTheWatchLimit(t *testing.T) {
	if !testkit.AtWatchLimit(t, 0) {
		return
	}
	logs := &testkit.Buffer{}
	w, err := New(logs.Logger())
	if err != nil {
		t.Fatal(err)
	}
	testkit.RunUntilEnd(t, w.Run)
	var subs []*Subscription
	for i := range 5 {
		dir := filepath.Join(testkit.ShortDir(t), fmt.Sprint(i))
		if err := os.Mkdir(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		subs = append(subs, subscribe(t, w, filepath.Join(dir, "f")))
	}
	n := 0
	for line := range strings.Lines(logs.String()) {
		if strings.Contains(line, "WARN") && strings.Contains(line, "max_user_watches") {
			n++
		}
	}
	if n != 1 {
		t.Errorf("%d warnings naming the watch limit for 5 paths, want 1:\n%s", n, logs.String())
	}
	if err := os.WriteFile("/proc/sys/user/max_inotify_watches", []byte("100"), 0); err != nil {
		t.Fatal(err)
	}
	for _, s := range subs {
		changes(t, s, Lost)
	}
	testkit.Eventually(t, 5*time.Second, "one line saying every directory is watched again", func() bool {
		return strings.Count(logs.String(), "watching every file's directory again") == 1
	})
}

// TestNewNamesTheInstanceLimit: with inotify's instances all taken, New's error names the
// instance limit, not the process's descriptors.
func TestNewNamesTheInstanceLimit(t *testing.T) {
	if !testkit.AtInstanceLimit(t, 0) {
		return
	}
	_, err := New(testkit.Logger(t))
	if err == nil || !strings.Contains(err.Error(), "fs.inotify.max_user_instances") {
		t.Errorf("New at the instance limit: %v, want an error naming fs.inotify.max_user_instances", err)
	}
}
