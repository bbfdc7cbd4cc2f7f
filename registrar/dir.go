package registrar

import (
	"context"
	"errors"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"multireg.dev/multireg/config"
)

// Dir is this process's hold on its registration directory: everything multireg keeps there
// besides the sockets' own life. It owns
//   - the lock that allows one multireg per directory (lock.go), checked every lockCheck by
//     Run and before every publish by Check;
//   - the record of the sockets multireg owns (owned.go), written for every applied
//     configuration and retried until it is written;
//   - the cleanup of what earlier runs left: temporary sockets of an interrupted publish, and
//     the sockets of drivers removed from the file while no multireg ran;
//   - moving to another directory when the configuration changes registrationDir (Move).
type Dir struct {
	log *slog.Logger

	// mu serializes every use of the lock: a check, a move, the release, and the write of
	// the owned record, which happens only while the lock is checked held.
	mu   sync.Mutex
	lock *dirLock

	rec ownedRecord
}

// OpenDir takes the registration directory of cfg, creating it (mode 0750) if missing. While
// another process holds it (a DaemonSet surge during a rolling update), it logs once that it
// waits and keeps trying until the lock is free or ctx ends; it returns ctx's error when ctx
// ends first, even once the lock is taken. Once held, it removes the temporary sockets an
// interrupted multireg may have left there, and the recorded sockets of drivers cfg no longer
// lists.
func OpenDir(ctx context.Context, cfg *config.RegistrarConfig, log *slog.Logger) (*Dir, error) {
	l, err := acquireLock(ctx, cfg.RegistrationDir, log)
	if err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil { // stopped while the lock was taken: touch nothing
		l.release()
		return nil, err
	}
	removeTempSockets(cfg.RegistrationDir, log)
	// Sockets of drivers removed from the file while no multireg ran: nothing else would
	// ever remove them, and kubelet would keep those plugins.
	if _, err := removeOrphans(cfg.RegistrationDir, socketNames(cfg), log); err != nil {
		log.Warn("look for sockets of drivers no longer configured", "err", err)
	}
	d := &Dir{log: log, lock: l}
	d.rec.log = log
	return d, nil
}

// Path returns the directory held, under the name the configuration gives it.
func (d *Dir) Path() string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.lock.dir
}

// Check makes sure this process still holds the directory (see dirLock.refresh): no socket
// is published there unless it passes. It fails with ErrDirLost once another instance holds it;
// any other failure is worth another try. It is the supervisor's Options.Guard.
func (d *Dir) Check() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.lock.refresh()
}

// Move prepares the move to dir of a configuration about to be applied: it takes dir's lock,
// failing at once when another process holds it, and removes dir's temporary sockets. done,
// called once the configuration is applied, lets go of the old directory. When dir is another
// name of the directory held (a symlink), nothing is locked again: done makes it the name
// checked from then on. It is the reloader's Options.MoveDir.
func (d *Dir) Move(dir string) (done func(), err error) {
	if sameDir(dir, d.Path()) {
		return func() {
			d.mu.Lock()
			defer d.mu.Unlock()
			d.lock.dir = dir
		}, nil
	}
	next, err := tryLock(dir, d.log)
	if err != nil {
		return nil, err
	}
	removeTempSockets(dir, d.log)
	return func() {
		d.mu.Lock()
		defer d.mu.Unlock()
		d.lock.release()
		d.lock = next
	}, nil
}

// Record records the sockets of cfg as the ones multireg owns, if this process still holds
// the directory; a write that fails is retried by Run until it succeeds. It is the reloader's
// Options.Applied.
func (d *Dir) Record(cfg *config.RegistrarConfig) {
	d.rec.set(cfg, d.writeRecord)
}

// writeRecord writes the record of cfg's sockets if this process holds the directory, under
// one hold of mu: the directory cannot be let go between the check and the write.
func (d *Dir) writeRecord(cfg *config.RegistrarConfig) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.lock.refresh(); err != nil {
		return err
	}
	return recordOwned(cfg.RegistrationDir, socketNames(cfg))
}

// Run checks every lockCheck that this process still holds the directory, and retries a
// record that could not be written. It returns nil when ctx ends, and an error wrapping
// ErrDirLost when another instance took the directory: this process must then stop serving
// without touching the sockets, which are that instance's.
func (d *Dir) Run(ctx context.Context) error {
	check := time.NewTicker(lockCheck)
	defer check.Stop()
	lastErr := "" // the last failure to check the lock, logged once
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-check.C:
		}
		err := d.Check()
		switch {
		case errors.Is(err, ErrDirLost):
			d.log.Error("stopping without touching the sockets: another instance serves this directory now", "err", err)
			return err
		case err != nil:
			// Nobody else can hold a lock file that cannot be made: the old one stays held,
			// and every publish waits for the check to pass.
			if msg := err.Error(); msg != lastErr {
				lastErr = msg
				d.log.Warn("cannot check the registration directory's lock; retrying every second", "err", err)
			}
			continue
		}
		lastErr = ""
		d.rec.retry(d.writeRecord)
	}
}

// Close lets the next instance take the directory. The lock file stays. A nil Dir closes
// nothing.
func (d *Dir) Close() error {
	if d == nil {
		return nil
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.lock.release()
}

// sameDir reports whether a and b name one existing directory.
func sameDir(a, b string) bool {
	fa, err := os.Stat(a)
	if err != nil {
		return false
	}
	fb, err := os.Stat(b)
	return err == nil && os.SameFile(fa, fb)
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
