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

// lockRetry paces the attempts to take a lock another process holds.
const lockRetry = 250 * time.Millisecond

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
	return acquire(ctx, dir, log, true)
}

// TryLock takes the exclusive lock of dir, like AcquireLock, but fails at once when another
// process holds it.
func TryLock(dir string, log *slog.Logger) (*Lock, error) {
	return acquire(context.Background(), dir, log, false)
}

func acquire(ctx context.Context, dir string, log *slog.Logger, wait bool) (*Lock, error) {
	if err := ensureDir(dir); err != nil {
		return nil, err
	}
	path := filepath.Join(dir, LockName)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open lock: %w", err)
	}
	t := time.NewTicker(lockRetry)
	defer t.Stop()
	waiting := false
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			break
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("lock %s: %w", path, err)
		}
		if !wait {
			f.Close()
			return nil, fmt.Errorf("another multireg holds %s", path)
		}
		if !waiting {
			waiting = true
			log.Info("another multireg holds the registration directory; waiting for it to exit", "lock", path)
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, ctx.Err()
		case <-t.C:
		}
	}
	if waiting {
		log.Info("took over the registration directory", "lock", path)
	}
	removeTempSockets(dir, log)
	return &Lock{dir: dir, f: f}, nil
}

// Release lets the next instance take the directory. The lock file stays.
func (l *Lock) Release() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.f.Close()
}

// Refresh makes sure the lock still holds the directory. Deleting the registration directory
// deletes the lock file with it; another instance waiting for the directory would then lock a
// new file. Refresh locks the new file instead, and fails if another instance got there first.
func (l *Lock) Refresh() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	path := filepath.Join(l.dir, LockName)
	var held, onDisk syscall.Stat_t
	if err := syscall.Fstat(int(l.f.Fd()), &held); err != nil {
		return fmt.Errorf("lock %s: %w", path, err)
	}
	if err := syscall.Stat(path, &onDisk); err == nil && onDisk.Dev == held.Dev && onDisk.Ino == held.Ino {
		return nil
	}
	next, err := acquire(context.Background(), l.dir, slog.New(slog.DiscardHandler), false)
	if err != nil {
		return fmt.Errorf("the registration directory was recreated and its lock lost: %w", err)
	}
	l.f.Close()
	l.f = next.f
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
