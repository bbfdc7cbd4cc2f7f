package registrar

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"
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
// LockCheck that the file at the path is the one it holds, and if not, locks the new one. A
// waiter that saw the directory held leaves a vanished or replaced lock file alone for
// lockGrace, so that a living holder re-locks it first; and when it does take a lock file
// other than the one it saw held (the holder did not come back in time), it waits lockSettle
// before it serves, so that a holder that was merely slow finds the directory lost and stops
// first. Variables, so that tests can shorten them.
var (
	// LockCheck is how often the holder makes sure it still holds the directory (Refresh).
	LockCheck = time.Second
	// lockRetry paces a waiter's attempts.
	lockRetry = 250 * time.Millisecond
	// lockGrace: a waiter does not take a new lock file for this long after the one it saw
	// held vanished or was replaced.
	lockGrace = 3 * time.Second
	// lockSettle: how long a waiter that took a lock file other than the one it saw held
	// waits before it serves.
	lockSettle = 2 * time.Second
)

// Lock is the exclusive hold of a registration directory.
type Lock struct {
	dir string
	mu  sync.Mutex
	f   *os.File
}

// AcquireLock takes the exclusive lock of dir, creating dir (mode 0750) if missing. While
// another process holds it (a DaemonSet surge during a rolling update), it logs once that it
// waits and keeps trying until the lock is free or ctx ends. Once held, it removes the
// temporary sockets an interrupted multireg may have left in dir.
func AcquireLock(ctx context.Context, dir string, log *slog.Logger) (*Lock, error) {
	f, err := acquire(ctx, dir, log, true)
	if err != nil {
		return nil, err
	}
	removeTempSockets(dir, log)
	return &Lock{dir: dir, f: f}, nil
}

// TryLock takes the exclusive lock of dir, like AcquireLock, but fails at once when another
// process holds it.
func TryLock(dir string, log *slog.Logger) (*Lock, error) {
	f, err := acquire(context.Background(), dir, log, false)
	if err != nil {
		return nil, err
	}
	removeTempSockets(dir, log)
	return &Lock{dir: dir, f: f}, nil
}

// fileKey identifies a file by device and inode: a lock follows the inode, not the path.
type fileKey struct{ dev, ino uint64 }

func keyOf(fi fs.FileInfo) fileKey {
	st := fi.Sys().(*syscall.Stat_t)
	return fileKey{dev: st.Dev, ino: st.Ino}
}

// keyAt returns the key of the file at path; the zero key when there is none.
func keyAt(path string) (fileKey, error) {
	fi, err := os.Stat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return fileKey{}, nil
	}
	if err != nil {
		return fileKey{}, err
	}
	return keyOf(fi), nil
}

// acquire returns the lock file of dir, locked and verified to be the file at the path.
func acquire(ctx context.Context, dir string, log *slog.Logger, wait bool) (*os.File, error) {
	path := filepath.Join(dir, LockName)
	var (
		f       *os.File
		seen    fileKey   // the lock file last seen held by another process
		changed time.Time // when the file at the path was first seen to differ from seen
		waiting bool
	)
	closeF := func() {
		if f != nil {
			f.Close()
			f = nil
		}
	}
	t := time.NewTicker(lockRetry)
	defer t.Stop()
	pause := func() error {
		select {
		case <-ctx.Done():
			closeF()
			return ctx.Err()
		case <-t.C:
			return nil
		}
	}
	for {
		if err := ensureDir(dir); err != nil {
			closeF()
			return nil, err
		}
		cur, err := keyAt(path)
		if err != nil {
			closeF()
			return nil, fmt.Errorf("lock %s: %w", path, err)
		}
		if seen != (fileKey{}) && cur != seen {
			// The lock file seen held vanished or was replaced: its holder, if it lives,
			// locks the new one within LockCheck. Leave it that long.
			closeF()
			if changed.IsZero() {
				changed = time.Now()
			}
			if time.Since(changed) < lockGrace {
				if err := pause(); err != nil {
					return nil, err
				}
				continue
			}
		}
		if f == nil {
			f, err = os.OpenFile(path, os.O_RDWR|os.O_CREATE|syscall.O_CLOEXEC, 0o600)
			if errors.Is(err, fs.ErrNotExist) && wait {
				// The directory went between the look and the open (an rm -rf): again.
				if err := pause(); err != nil {
					return nil, err
				}
				continue
			}
			if err != nil {
				return nil, fmt.Errorf("open lock %s: %w", path, err)
			}
		}
		held, err := f.Stat()
		if err != nil {
			closeF()
			return nil, fmt.Errorf("lock %s: %w", path, err)
		}
		err = syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		switch {
		case err == nil:
			// Locked; but the file may have been replaced or removed meanwhile, and a lock
			// on a file that is no longer at the path holds nothing.
			if now, err := keyAt(path); err != nil || now != keyOf(held) {
				closeF()
				if !wait {
					return nil, fmt.Errorf("lock %s: the file was replaced or removed while it was being locked", path)
				}
				if err := pause(); err != nil {
					return nil, err
				}
				continue
			}
		case errors.Is(err, syscall.EWOULDBLOCK):
			if !wait {
				closeF()
				return nil, fmt.Errorf("%w: %s", errHeld, path)
			}
			seen, changed = keyOf(held), time.Time{}
			if !waiting {
				waiting = true
				log.Info("another multireg holds the registration directory; waiting for it to exit", "lock", path)
			}
			if err := pause(); err != nil {
				return nil, err
			}
			continue
		default:
			closeF()
			return nil, fmt.Errorf("lock %s: %w", path, err)
		}
		if seen != (fileKey{}) && keyOf(held) != seen {
			// Not the file the other instance held: it lost its lock file and did not come
			// back for it in time. If it still runs, it finds the directory lost within
			// LockCheck and stops: let it, before serving.
			log.Info("the lock file of the registration directory was replaced; waiting for its former holder to stop", "lock", path, "wait", lockSettle)
			select {
			case <-ctx.Done():
				closeF()
				return nil, ctx.Err()
			case <-time.After(lockSettle):
			}
			if now, err := keyAt(path); err != nil || now != keyOf(held) {
				closeF()
				continue
			}
		}
		if waiting {
			log.Info("took over the registration directory", "lock", path)
		}
		return f, nil
	}
}

// Release lets the next instance take the directory. The lock file stays.
func (l *Lock) Release() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.f.Close()
}

// Dir returns the directory the lock holds, under the name the configuration gives it.
func (l *Lock) Dir() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.dir
}

// Rename makes dir the name under which Refresh checks the lock: another name (a symlink) of
// the directory already held, as a changed configuration spells it.
func (l *Lock) Rename(dir string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.dir = dir
}

// Refresh makes sure the lock still holds the directory; the holder calls it every LockCheck.
// When the lock file was deleted or replaced (the directory recreated, an operator's rm), it
// locks the file now at the path, creating it if needed, before it lets go of the old one.
// When another instance holds the file at the path, it fails with ErrDirLost; any other
// failure (the directory or its parent missing at the moment) keeps the old lock and is
// worth another try.
func (l *Lock) Refresh() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	path := filepath.Join(l.dir, LockName)
	held, err := l.f.Stat()
	if err != nil {
		return fmt.Errorf("lock %s: %w", path, err)
	}
	if cur, err := keyAt(path); err == nil && cur == keyOf(held) {
		return nil
	}
	next, err := acquire(context.Background(), l.dir, slog.New(slog.DiscardHandler), false)
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

// removeTempSockets removes the hidden temporary sockets of an interrupted publish. Only
// sockets named as multireg names them are touched.
func removeTempSockets(dir string, log *slog.Logger) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, e := range entries {
		if !isTempSocketName(e.Name()) || e.Type() != fs.ModeSocket {
			continue
		}
		p := filepath.Join(dir, e.Name())
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			log.Warn("remove leftover temporary socket", "path", p, "err", err)
		}
	}
}
