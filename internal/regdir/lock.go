package regdir

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/sockfile"
)

// LockName is the lock file that allows one multireg per registration directory. Its leading
// dot makes kubelet ignore it.
const LockName = ".multireg.lock"

// errHeld: another process holds the lock file at the path.
var errHeld = errors.New("another multireg holds the lock")

// ErrDirLost reports that another instance now holds the registration directory: the sockets
// in it are no longer this process's, and it must stop serving without touching them.
var ErrDirLost = errors.New("another multireg took over the registration directory")

// The lock protocol. A lock held on a file that is no longer the one at the path is no lock:
// the lock file may be deleted, replaced, or go with its directory. The holder checks every
// lockCheck that the file at the path is the one it holds, and if not, locks the new one. A
// waiter that saw the directory held leaves a vanished or replaced lock file alone for
// lockGrace, so that a living holder re-locks it first; and when it does take a lock file
// other than the one it saw held (the holder did not come back in time), it waits lockSettle
// before it serves, so that a holder that was merely slow finds the directory lost and stops
// first.
const (
	// lockCheck is how often the holder makes sure it still holds the directory (Dir.Run, Dir.Check).
	lockCheck = time.Second
	// lockRetry paces a waiter's attempts.
	lockRetry = 250 * time.Millisecond
	// lockGrace: a waiter does not take a new lock file for this long after the one it saw
	// held vanished or was replaced.
	lockGrace = 3 * time.Second
	// lockSettle: how long a waiter that took a lock file other than the one it saw held
	// waits before it serves.
	lockSettle = 2 * time.Second
)

// lockPace is how a waiter makes its way to the lock: lockRetry, lockGrace and lockSettle, the
// defaults (defaultPace), which the package's tests shorten.
type lockPace struct {
	retry, grace, settle time.Duration
}

// defaultPace is the pace of every waiter of the process.
func defaultPace() lockPace {
	return lockPace{retry: lockRetry, grace: lockGrace, settle: lockSettle}
}

// dirLock is the exclusive hold of a registration directory: the lock file in it, flocked,
// and the name under which it is checked. It is not safe for concurrent use: Dir serializes.
type dirLock struct {
	dir string
	f   *os.File
}

// acquireLock takes the exclusive lock of dir, creating dir (mode 0750) if missing. While
// another process holds it, it logs once that it waits and keeps trying, at pace p, until the
// lock is free or ctx ends.
func acquireLock(ctx context.Context, dir string, log *slog.Logger, p lockPace) (*dirLock, error) {
	f, err := acquire(ctx, dir, log, true, p)
	if err != nil {
		return nil, err
	}
	return &dirLock{dir: dir, f: f}, nil
}

// tryLock takes the exclusive lock of dir, like acquireLock, but fails at once when another
// process holds it.
func tryLock(dir string, log *slog.Logger) (*dirLock, error) {
	f, err := acquire(context.Background(), dir, log, false, defaultPace())
	if err != nil {
		return nil, err
	}
	return &dirLock{dir: dir, f: f}, nil
}

// acquire returns the lock file of dir, locked and verified to be the file at the path; a
// waiter waits at pace p.
func acquire(ctx context.Context, dir string, log *slog.Logger, wait bool, p lockPace) (*os.File, error) {
	a := &acquisition{dir: dir, path: filepath.Join(dir, LockName), log: log, wait: wait, pace: p}
	t := time.NewTicker(p.retry)
	defer t.Stop()
	for {
		f, again, err := a.try(ctx)
		if !again {
			if f != nil && a.waiting {
				log.Info("took over the registration directory", "lock", a.path)
			}
			return f, err
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-t.C:
		}
	}
}

// acquisition is one process's way to a directory's lock: what it saw held on the way.
type acquisition struct {
	dir, path string
	log       *slog.Logger
	wait      bool // wait while another process holds the lock, rather than fail
	pace      lockPace

	seen    fsid.Key  // the lock file last seen held by another process
	changed time.Time // when the file at the path was first seen to differ from seen
	waiting bool      // said that it waits
}

// try makes one attempt: it returns the lock file, locked; or again, to try anew after a
// pause; or an error.
func (a *acquisition) try(ctx context.Context) (f *os.File, again bool, err error) {
	if err := sockfile.EnsureDir(a.dir); err != nil {
		return nil, false, err
	}
	cur, err := fsid.KeyAt(a.path)
	if err != nil {
		return nil, false, fmt.Errorf("lock %s: %w", a.path, err)
	}
	if a.seen != (fsid.Key{}) && cur != a.seen {
		// The lock file seen held vanished or was replaced: its holder, if it lives, locks
		// the new one within lockCheck. Leave it that long.
		if a.changed.IsZero() {
			a.changed = time.Now()
		}
		if time.Since(a.changed) < a.pace.grace {
			return nil, true, nil
		}
	}
	f, err = os.OpenFile(a.path, os.O_RDWR|os.O_CREATE|syscall.O_CLOEXEC, 0o600)
	if errors.Is(err, fs.ErrNotExist) && a.wait {
		return nil, true, nil // the directory went between the look and the open (an rm -rf)
	}
	if err != nil {
		return nil, false, fmt.Errorf("open lock %s: %w", a.path, err)
	}
	held, again, err := a.lock(f)
	if again || err != nil {
		f.Close()
		return nil, again, err
	}
	if a.seen != (fsid.Key{}) && held != a.seen {
		// Not the file the other instance held: it lost its lock file and did not come back
		// for it in time. If it still runs, it finds the directory lost within lockCheck and
		// stops: let it, before serving.
		a.log.Info("the lock file of the registration directory was replaced; waiting for its former holder to stop", "lock", a.path, "wait", a.pace.settle)
		select {
		case <-ctx.Done():
			f.Close()
			return nil, false, ctx.Err()
		case <-time.After(a.pace.settle):
		}
		if now, err := fsid.KeyAt(a.path); err != nil || now != held {
			f.Close()
			return nil, true, nil
		}
	}
	return f, false, nil
}

// lock locks f, opened at the path, and returns its key once it is locked and still the file
// at the path: a lock on a file that is no longer at the path holds nothing. It reports again
// while another process holds it (when waiting) or the file was replaced meanwhile.
func (a *acquisition) lock(f *os.File) (held fsid.Key, again bool, err error) {
	fi, err := f.Stat()
	if err != nil {
		return fsid.Key{}, false, fmt.Errorf("lock %s: %w", a.path, err)
	}
	held = fsid.KeyOf(fi)
	err = syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
	switch {
	case err == nil:
		if now, err := fsid.KeyAt(a.path); err != nil || now != held {
			if !a.wait {
				return fsid.Key{}, false, fmt.Errorf("lock %s: the file was replaced or removed while it was being locked", a.path)
			}
			return fsid.Key{}, true, nil
		}
		return held, false, nil
	case errors.Is(err, syscall.EWOULDBLOCK):
		if !a.wait {
			return fsid.Key{}, false, fmt.Errorf("%w: %s", errHeld, a.path)
		}
		a.seen, a.changed = held, time.Time{}
		if !a.waiting {
			a.waiting = true
			a.log.Info("another multireg holds the registration directory; waiting for it to exit", "lock", a.path)
		}
		return fsid.Key{}, true, nil
	}
	return fsid.Key{}, false, fmt.Errorf("lock %s: %w", a.path, err)
}

// release lets the next instance take the directory. The lock file stays.
func (l *dirLock) release() error {
	return l.f.Close()
}

// refresh makes sure the lock still holds the directory; the holder calls it every lockCheck.
// When the lock file was deleted or replaced (the directory recreated, an operator's rm), it
// locks the file now at the path, creating it if needed, before it lets go of the old one.
// When another instance holds the file at the path, it fails with ErrDirLost; any other
// failure (the directory or its parent missing at the moment) keeps the old lock and is
// worth another try.
func (l *dirLock) refresh() error {
	path := filepath.Join(l.dir, LockName)
	held, err := l.f.Stat()
	if err != nil {
		return fmt.Errorf("lock %s: %w", path, err)
	}
	if cur, err := fsid.KeyAt(path); err == nil && cur == fsid.KeyOf(held) {
		return nil
	}
	next, err := acquire(context.Background(), l.dir, slog.New(slog.DiscardHandler), false, defaultPace())
	if errors.Is(err, errHeld) {
		return fmt.Errorf("%w: the lock file %s was replaced or removed, and another process holds the new one", ErrDirLost, path)
	}
	if err != nil {
		return fmt.Errorf("the lock file %s was replaced or removed, and locking it again failed: %w", path, err)
	}
	l.f.Close()
	l.f = next
	return nil
}

// lockFileOf checks that f, received as the directory's lock, is the lock file at dir's path.
func lockFileOf(f *os.File, dir string) error {
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("the lock descriptor is not a regular file")
	}
	cur, err := fsid.KeyAt(filepath.Join(dir, LockName))
	if err != nil {
		return err
	}
	if cur != fsid.KeyOf(fi) {
		return fmt.Errorf("the lock descriptor is not the file at %s", filepath.Join(dir, LockName))
	}
	return nil
}
