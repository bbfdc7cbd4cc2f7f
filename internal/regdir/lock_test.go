package regdir

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/testkit"
)

func TestLockWaitsAndTakesOver(t *testing.T) {
	dir := filepath.Join(testkit.ShortDir(t), "reg")
	var logs testkit.Buffer
	first, err := acquireLock(context.Background(), dir, logs.Logger(), defaultPace())
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan *dirLock, 1)
	go func() {
		l, err := acquireLock(context.Background(), dir, logs.Logger(), defaultPace())
		if err != nil {
			t.Error(err)
		}
		got <- l
	}()
	testkit.Eventually(t, 5*time.Second, "the second instance to say it waits", func() bool {
		return strings.Contains(logs.String(), "waiting for it to exit")
	})
	select {
	case <-got:
		t.Fatal("a second instance took a held lock")
	default:
	}
	first.release()
	select {
	case l := <-got:
		l.release()
	case <-time.After(5 * time.Second):
		t.Fatal("the second instance did not take over")
	}
	if !strings.Contains(logs.String(), "took over") {
		t.Errorf("no take-over line in:\n%s", logs.String())
	}

	// A waiting instance gives up when its context ends.
	held, err := acquireLock(context.Background(), dir, logs.Logger(), defaultPace())
	if err != nil {
		t.Fatal(err)
	}
	defer held.release()
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if _, err := acquireLock(ctx, dir, logs.Logger(), defaultPace()); err != context.DeadlineExceeded {
		t.Errorf("acquireLock with an ended context: %v", err)
	}
}

func TestDirRemovesOnlyOurTempSockets(t *testing.T) {
	dir := filepath.Join(testkit.ShortDir(t), "reg")
	if err := os.MkdirAll(dir, 0o750); err != nil {
		t.Fatal(err)
	}
	mk := func(name string) string {
		p := filepath.Join(dir, name)
		l, err := testkit.ListenUnlinked(p)
		if err != nil {
			t.Fatal(err)
		}
		l.Close()
		return p
	}
	ours := mk(".mr-0123abcd.tmp")
	theirs := mk(".other.tmp")
	plugin := mk("x-reg.sock")
	notSocket := filepath.Join(dir, ".mr-ffffffff.tmp")
	if err := os.WriteFile(notSocket, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	openDir(t, dir)
	if _, err := os.Lstat(ours); !os.IsNotExist(err) {
		t.Errorf("leftover temporary socket: %v, want removed", err)
	}
	for _, p := range []string{theirs, plugin, notSocket} {
		if _, err := os.Lstat(p); err != nil {
			t.Errorf("%s was touched: %v", p, err)
		}
	}
}

// openDir opens the registration directory dir for one test, and closes it at its end.
func openDir(t *testing.T, dir string) *Dir {
	t.Helper()
	return openDirWith(t, dir, Options{})
}

// openDirWith is openDir with opts.
func openDirWith(t *testing.T, dir string, opts Options) *Dir {
	t.Helper()
	d, _, err := Open(context.Background(), &config.RegistrarConfig{RegistrationDir: dir}, testkit.Logger(t), opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

// fastPace is the lock protocol's pace with its pauses shortened, for the tests.
var fastPace = lockPace{retry: 5 * time.Millisecond, grace: 150 * time.Millisecond, settle: 100 * time.Millisecond}

// waitingLock starts a second instance's acquireLock on dir, at fastPace, and returns once it
// says it waits.
func waitingLock(t *testing.T, dir string, logs *testkit.Buffer) <-chan *dirLock {
	t.Helper()
	got := make(chan *dirLock, 1)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	t.Cleanup(func() {
		cancel()
		<-done
	})
	go func() {
		defer close(done)
		l, err := acquireLock(ctx, dir, logs.Logger(), fastPace)
		if err == nil {
			got <- l
		}
	}()
	testkit.Eventually(t, 5*time.Second, "the second instance to say it waits", func() bool {
		return strings.Contains(logs.String(), "waiting for it to exit")
	})
	return got
}

// holdsPath reports whether l holds the lock file now at its path.
func holdsPath(t *testing.T, l *dirLock) bool {
	t.Helper()
	fi, err := l.f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	cur, err := fsid.KeyAt(filepath.Join(l.dir, LockName))
	return err == nil && cur == fsid.KeyOf(fi)
}

// TestLockFileGoneWhileAnotherWaits: the lock file of a held directory is deleted, replaced
// or goes with its directory while a second instance waits. The holder, checking as it does
// every lockCheck, locks the new file; the waiter never takes the directory from it — not the
// new file, and not the old one when the holder lets go of it — and takes over only once the
// holder exits.
func TestLockFileGoneWhileAnotherWaits(t *testing.T) {
	for _, tc := range []struct {
		name string
		harm func(dir string) error
	}{
		{"deleted", func(dir string) error { return os.Remove(filepath.Join(dir, LockName)) }},
		{"replaced", func(dir string) error {
			other := filepath.Join(dir, "other")
			if err := os.WriteFile(other, nil, 0o600); err != nil {
				return err
			}
			return os.Rename(other, filepath.Join(dir, LockName))
		}},
		{"directory recreated", func(dir string) error {
			if err := os.RemoveAll(dir); err != nil {
				return err
			}
			return os.Mkdir(dir, 0o750)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := filepath.Join(testkit.ShortDir(t), "reg")
			var logs testkit.Buffer
			holder, err := acquireLock(context.Background(), dir, logs.Logger(), defaultPace())
			if err != nil {
				t.Fatal(err)
			}
			got := waitingLock(t, dir, &logs)
			if err := tc.harm(dir); err != nil {
				t.Fatal(err)
			}
			// The holder checks a few times, as its lockCheck ticker would, for longer than
			// the waiter's grace and settle together.
			deadline := time.Now().Add(3 * (fastPace.grace + fastPace.settle))
			for time.Now().Before(deadline) {
				if err := holder.refresh(); err != nil {
					t.Fatalf("the holder lost the directory: %v\n%s", err, logs.String())
				}
				select {
				case l := <-got:
					l.release()
					t.Fatalf("the waiting instance took the directory from its holder:\n%s", logs.String())
				case <-time.After(fastPace.grace / 5):
				}
			}
			if !holdsPath(t, holder) {
				t.Fatal("the holder does not hold the lock file at the path")
			}
			holder.release()
			select {
			case l := <-got:
				defer l.release()
				if !holdsPath(t, l) {
					t.Error("the second instance holds a lock file that is not at the path")
				}
			case <-time.After(5 * time.Second):
				t.Fatalf("the second instance did not take over after the holder exited:\n%s", logs.String())
			}
		})
	}
}

// TestLockHolderTooSlow: a holder that does not check in time (stopped, starved) loses the
// directory: the waiter takes the new lock file after its grace and settle, and the holder's
// next check says the directory is lost.
func TestLockHolderTooSlow(t *testing.T) {
	dir := filepath.Join(testkit.ShortDir(t), "reg")
	var logs testkit.Buffer
	holder, err := acquireLock(context.Background(), dir, logs.Logger(), defaultPace())
	if err != nil {
		t.Fatal(err)
	}
	defer holder.release()
	got := waitingLock(t, dir, &logs)
	if err := os.Remove(filepath.Join(dir, LockName)); err != nil {
		t.Fatal(err)
	}
	// The waiter has taken the new file and settles, or is done: the holder's check fails
	// either way, before the waiter serves or right after.
	testkit.Eventually(t, 5*time.Second, "the waiter to take the new lock file", func() bool {
		return strings.Contains(logs.String(), "waiting for its former holder to stop")
	})
	if err := holder.refresh(); !errors.Is(err, ErrDirLost) {
		t.Fatalf("Refresh of a lost directory: %v, want ErrDirLost", err)
	}
	select {
	case l := <-got:
		defer l.release()
		if !holdsPath(t, l) {
			t.Error("the new holder's lock file is not at the path")
		}
	case <-time.After(5 * time.Second):
		t.Fatalf("the waiter did not take over:\n%s", logs.String())
	}
}

// TestLockCreatesOnlyTheDirectory: the registration directory is created as kubelet creates
// it (0750); a missing parent (kubelet's root directory) is an error naming it, and is not
// created.
func TestLockCreatesOnlyTheDirectory(t *testing.T) {
	base := testkit.ShortDir(t)
	dir := filepath.Join(base, "reg")
	l, err := tryLock(dir, testkit.Logger(t))
	if err != nil {
		t.Fatal(err)
	}
	l.release()
	if fi, err := os.Stat(dir); err != nil || fi.Mode().Perm() != 0o750 {
		t.Errorf("registration directory: %v, %v; want mode 0750", fi.Mode(), err)
	}
	deep := filepath.Join(base, "kubelet", "plugins_registry")
	_, err = tryLock(deep, testkit.Logger(t))
	if err == nil || !strings.Contains(err.Error(), filepath.Join(base, "kubelet")+" does not exist") {
		t.Errorf("lock under a missing parent: %v, want an error naming the parent", err)
	}
	if _, err := os.Lstat(filepath.Join(base, "kubelet")); !os.IsNotExist(err) {
		t.Errorf("the missing parent was created: %v", err)
	}
}

// TestLockRefreshWithoutItsDirectory: a lock that cannot be checked because the directory and
// its parent are gone is not lost (nobody else can hold a lock file there); it is taken again
// once the directory is back.
func TestLockRefreshWithoutItsDirectory(t *testing.T) {
	base := filepath.Join(testkit.ShortDir(t), "kubelet")
	if err := os.Mkdir(base, 0o750); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(base, "reg")
	l, err := tryLock(dir, testkit.Logger(t))
	if err != nil {
		t.Fatal(err)
	}
	defer l.release()
	if err := os.RemoveAll(base); err != nil {
		t.Fatal(err)
	}
	if err := l.refresh(); err == nil || errors.Is(err, ErrDirLost) {
		t.Fatalf("Refresh without the parent directory: %v, want an error that is not ErrDirLost", err)
	}
	if err := os.Mkdir(base, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := l.refresh(); err != nil {
		t.Fatalf("Refresh once the parent is back: %v", err)
	}
	if !holdsPath(t, l) {
		t.Error("the lock file at the path is not held")
	}
}

// TestDirMovedToAnotherName: a directory taken through a symlink and moved to the
// directory's real name is checked under that name: the symlink's removal neither makes a
// directory in its place nor lets go of the real one.
func TestDirMovedToAnotherName(t *testing.T) {
	base := testkit.ShortDir(t)
	real, alias := filepath.Join(base, "reg"), filepath.Join(base, "alias")
	if err := os.Mkdir(real, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("reg", alias); err != nil {
		t.Fatal(err)
	}
	d := openDir(t, alias)
	done, err := d.Move(real)
	if err != nil {
		t.Fatal(err)
	}
	done()
	if d.Path() != real {
		t.Errorf("Path() = %s after the move, want %s", d.Path(), real)
	}
	if err := os.Remove(alias); err != nil {
		t.Fatal(err)
	}
	if err := d.Check(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(alias); !os.IsNotExist(err) {
		t.Errorf("%s after Check: %v, want nothing there", alias, err)
	}
	if _, err := tryLock(real, testkit.Logger(t)); err == nil {
		t.Error("another instance took the directory")
	}
}

// TestLockRefresh: after the registration directory is recreated, the instance that holds it
// locks the new lock file, or learns that another instance got there first.
func TestLockRefresh(t *testing.T) {
	dir := filepath.Join(testkit.ShortDir(t), "reg")
	log := testkit.Logger(t)
	first, err := acquireLock(context.Background(), dir, log, defaultPace())
	if err != nil {
		t.Fatal(err)
	}
	defer first.release()
	if err := first.refresh(); err != nil {
		t.Fatalf("Refresh of an intact lock: %v", err)
	}
	recreate := func() {
		if err := os.RemoveAll(dir); err != nil {
			t.Fatal(err)
		}
		if err := os.Mkdir(dir, 0o750); err != nil {
			t.Fatal(err)
		}
	}
	recreate()
	if err := first.refresh(); err != nil {
		t.Fatalf("Refresh after the directory was recreated: %v", err)
	}
	if _, err := tryLock(dir, log); err == nil {
		t.Fatal("a second instance took the recreated directory from the holder")
	}

	recreate()
	second, err := tryLock(dir, log) // the second instance is first this time
	if err != nil {
		t.Fatal(err)
	}
	defer second.release()
	if err := first.refresh(); err == nil {
		t.Error("Refresh did not report the lost directory")
	}
}

// TestDirRunStopsWhenLost: Run keeps the directory while its lock file is merely replaced,
// and ends with ErrDirLost once another instance holds the file at the path.
func TestDirRunStopsWhenLost(t *testing.T) {
	dir := filepath.Join(testkit.ShortDir(t), "reg")
	d := openDir(t, dir)
	d.check = 10 * time.Millisecond
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ran := make(chan error, 1)
	go func() { ran <- d.Run(ctx, nil) }()

	lockFile := filepath.Join(dir, LockName)
	if err := os.Remove(lockFile); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 5*time.Second, "the holder to lock the new lock file", func() bool {
		_, err := os.Lstat(lockFile)
		d.mu.Lock()
		defer d.mu.Unlock()
		return err == nil && holdsPath(t, d.lock)
	})
	// Another instance's lock file, held, replaces it in one step.
	other, err := os.OpenFile(filepath.Join(dir, "other.lock"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if err := syscall.Flock(int(other.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(other.Name(), lockFile); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-ran:
		if !errors.Is(err, ErrDirLost) {
			t.Errorf("Run: %v, want ErrDirLost", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Run did not stop once another instance held the directory")
	}
}
