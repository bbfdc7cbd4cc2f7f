package regdir

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/handover"
	"multireg.dev/multireg/internal/sockfile"
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

	// guards: lock (and the dirLock it points to, Dir's alone), released. It serializes every
	// use of the lock: a check, a move, the release, and the write of the owned record, which
	// happens only while the lock is checked held.
	mu   sync.Mutex
	lock *dirLock
	// released: the lock went to another instance by a hand-over; nothing is released again.
	released bool

	rec ownedRecord

	// requests carries hand-over requests from the accepting goroutines to Run, which serves
	// each on a goroutine of its own; pending bounds how many are accepted and not yet served
	// (maxRequests); handed carries a hand-over's end to Run. wg waits for every goroutine:
	// the accepting ones end when their listener is closed (Close, or a move).
	requests chan *net.UnixConn
	pending  chan struct{}
	handed   chan error
	// guards: inflight, the requests being served (Close closes them), and closing.
	reqMu    sync.Mutex
	inflight map[*net.UnixConn]struct{}
	closing  bool
	// applied is closed once a configuration is applied (Record): only then does Run serve
	// hand-over requests, so that a snapshot holds every driver of the file.
	applied     chan struct{}
	appliedOnce sync.Once
	hl          *handover.Listener // nil when hand-overs are off or could not be listened for
	wg          sync.WaitGroup
	closed      chan struct{}
	once        sync.Once
	timeouts    handover.Timeouts // bound the hand-overs served (Options.Handover)
	check       time.Duration     // how often Run checks the lock: lockCheck; the package's tests shorten it
}

// Options say how Open takes the directory.
type Options struct {
	// Ask: when another instance holds the directory, ask it to hand the directory over
	// (internal/handover) before waiting for it. A new process asks, once; one that handed over
	// never does.
	Ask bool
	// Kept are sockets this process kept from an earlier hand-over: its own, handed over
	// to an instance that has since ended, or those received in a hand-over that did not
	// complete. They are returned with whatever else is received.
	Kept *handover.Snapshot
	// Standby, if set, is called when this process starts waiting for the directory, with why.
	Standby func(why string)
	// Handover bounds the steps of the hand-overs Run serves (zero: the defaults).
	Handover handover.Timeouts
	// Listeners are the listening TCP sockets this process serves (its flags): a hand-over
	// brings the holder's, of this network namespace (handover.Ask).
	Listeners []handover.ListenerSpec
}

// Open takes the registration directory of cfg, creating it (mode 0750) if missing. While
// another process holds it (a DaemonSet surge during a rolling update), it logs once that it
// waits and keeps trying until the lock is free or ctx ends; it returns ctx's error when ctx
// ends first, even once the lock is taken. Once held, it removes the temporary sockets an
// interrupted multireg may have left there, and the recorded sockets of drivers cfg no longer
// lists.
//
// With opts.Ask, it first asks the holder to hand the directory over. It returns the sockets
// a hand-over brought, with opts.Kept: the Supervisor serves them (TakeOver).
func Open(ctx context.Context, cfg *config.RegistrarConfig, log *slog.Logger, opts Options) (*Dir, *handover.Snapshot, error) {
	snap, l, err := takeDir(ctx, cfg, log, opts)
	if err == nil {
		err = ctx.Err() // stopped while the lock was taken: touch nothing
		if err != nil {
			l.release()
		}
	}
	if err != nil {
		snap.Close()
		return nil, nil, err
	}
	removeTempSockets(cfg.RegistrationDir, log)
	// Sockets of drivers removed from the file while no multireg ran: nothing else would
	// ever remove them, and kubelet would keep those plugins.
	if _, err := removeOrphans(cfg.RegistrationDir, socketNames(cfg), log); err != nil {
		log.Warn("look for sockets of drivers no longer configured", "err", err)
	}
	d := &Dir{log: log, lock: l, requests: make(chan *net.UnixConn), applied: make(chan struct{}), closed: make(chan struct{}),
		pending: make(chan struct{}, maxRequests), handed: make(chan error, 1), inflight: map[*net.UnixConn]struct{}{},
		timeouts: opts.Handover, check: lockCheck}
	d.rec.log = log
	d.listen(cfg.RegistrationDir)
	return d, snap, nil
}

// takeDir takes the lock of cfg's directory as Open does, and returns it with the sockets a
// hand-over brought (what cfg's drivers can use of it: handover.Ask) and opts.Kept.
func takeDir(ctx context.Context, cfg *config.RegistrarConfig, log *slog.Logger, opts Options) (*handover.Snapshot, *dirLock, error) {
	dir := cfg.RegistrationDir
	snap := opts.Kept
	l, err := tryLock(dir, log)
	if !errors.Is(err, errHeld) {
		return snap, l, err
	}
	why := "another instance holds the registration directory"
	if opts.Ask && handover.Enabled() {
		got, lf, err := handover.Ask(dir, log, func(f *os.File) error { return lockFileOf(f, dir) }, driverNames(cfg), opts.Listeners)
		drivers, sockets := got.Len(), got.Sockets()
		if got != nil {
			if snap == nil {
				snap = &handover.Snapshot{}
			}
			snap.Merge(got)
		}
		if err == nil {
			log.Info("took over the registration directory from the previous instance", "drivers", drivers, "sockets", sockets)
			return snap, &dirLock{dir: dir, f: lf}, nil
		}
		why = err.Error()
		log.Warn("no hand-over; waiting for the previous instance to exit", "err", err, "socketsKept", snap.Sockets())
	}
	if opts.Standby != nil {
		opts.Standby(why)
	}
	l, err = acquireLock(ctx, dir, log, defaultPace())
	return snap, l, err
}

// listen listens for hand-over requests in dir, if this process takes part in hand-overs,
// and accepts them for Run. A failure leaves the directory without: a new instance then
// waits for this one to exit.
func (d *Dir) listen(dir string) {
	if !handover.Enabled() {
		return
	}
	l, err := handover.Listen(dir)
	if err != nil {
		d.log.Warn("hand-overs unavailable: a new instance will wait for this one to exit", "err", err)
		return
	}
	d.mu.Lock()
	d.hl = l
	d.mu.Unlock()
	d.wg.Go(func() {
		for {
			select { // a place among the pending first: beyond maxRequests, requests wait in the kernel's queue
			case d.pending <- struct{}{}:
			case <-d.closed:
				return
			}
			c, err := l.AcceptUnix()
			if err != nil {
				<-d.pending
				return // closed
			}
			select {
			case d.requests <- c:
			case <-d.closed:
				c.Close()
				<-d.pending
				return
			}
		}
	})
}

// maxRequests bounds the hand-over requests served at once: each costs a goroutine and
// handover.Timeouts.Hello at most when it says nothing.
const maxRequests = 256

// serve serves the hand-over request c on a goroutine of its own, which frees c's place; a
// hand-over's end goes to Run.
func (d *Dir) serve(srv *handover.Server, c *net.UnixConn) {
	d.reqMu.Lock()
	defer d.reqMu.Unlock()
	if d.closing {
		c.Close()
		<-d.pending
		return
	}
	d.inflight[c] = struct{}{}
	d.wg.Go(func() {
		defer func() {
			d.reqMu.Lock()
			delete(d.inflight, c)
			d.reqMu.Unlock()
			<-d.pending
		}()
		if err := srv.Serve(c); err != nil {
			d.handed <- err // one hand-over at most: the server refuses any after it
		}
	})
}

// held is the lock's side of a hand-over (handover.Lock).
type held struct{ d *Dir }

func (h held) File() (*os.File, error) { return h.d.lockFile() }
func (h held) Let()                    { h.d.let() }

// lockFile is a new descriptor of the lock's open file, passed to the new instance in a
// hand-over; the caller closes it.
func (d *Dir) lockFile() (*os.File, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	rc, err := d.lock.f.SyscallConn()
	if err != nil {
		return nil, err
	}
	fd, derr := -1, error(nil)
	if err := rc.Control(func(u uintptr) { fd, derr = unix.FcntlInt(u, unix.F_DUPFD_CLOEXEC, 0) }); err != nil {
		return nil, err
	}
	if derr != nil {
		return nil, fmt.Errorf("copy the lock's descriptor: %w", derr)
	}
	return os.NewFile(uintptr(fd), d.lock.f.Name()), nil
}

// let lets go of the lock after a hand-over: the new instance holds the same open file.
func (d *Dir) let() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.lock.release()
	d.released = true
	d.closeListener()
}

// closeListener stops accepting hand-over requests; mu is held.
func (d *Dir) closeListener() {
	if d.hl != nil {
		d.hl.Close()
		d.hl = nil
	}
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
		if d.released { // handed over meanwhile: the new directory is nobody's to keep
			d.mu.Unlock()
			next.release()
			return
		}
		d.lock.release()
		d.lock = next
		d.closeListener()
		d.mu.Unlock()
		d.listen(dir)
	}, nil
}

// Record records the sockets of cfg as the ones multireg owns, if this process still holds
// the directory; a write that fails is retried by Run until it succeeds. It is the reloader's
// Options.Applied.
func (d *Dir) Record(cfg *config.RegistrarConfig) {
	d.appliedOnce.Do(func() { close(d.applied) })
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

// Run checks every lockCheck that this process still holds the directory, retries a record
// that could not be written, and serves hand-over requests with h (none when nil), each on a
// goroutine of its own, maxRequests at most at once: no request delays the lock's check. It returns
// nil when ctx ends; an error wrapping ErrDirLost when another instance took the directory:
// this process must then stop serving without touching the sockets, which are that
// instance's; and a *HandedOver after a hand-over.
func (d *Dir) Run(ctx context.Context, h handover.Holder) error {
	check := time.NewTicker(d.check)
	defer check.Stop()
	lastErr := "" // the last failure to check the lock, logged once
	applied := d.applied
	var requests <-chan *net.UnixConn // once a configuration is applied
	var srv *handover.Server
	if h != nil {
		srv = handover.NewServer(h, held{d}, d.log, d.timeouts)
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-applied:
			applied, requests = nil, d.requests
			continue
		case c := <-requests:
			if srv == nil {
				c.Close()
				<-d.pending
				continue
			}
			d.serve(srv, c)
			continue
		case err := <-d.handed:
			return err
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

// Close lets the next instance take the directory, and stops accepting hand-over requests.
// The lock file stays. A nil Dir closes nothing.
func (d *Dir) Close() error {
	if d == nil {
		return nil
	}
	d.once.Do(func() { close(d.closed) })
	d.reqMu.Lock()
	d.closing = true
	for c := range d.inflight {
		c.Close() // its hand-over fails: the loops run again, or stay stopped once Run ended
	}
	d.reqMu.Unlock()
	d.mu.Lock()
	d.closeListener()
	var err error
	if !d.released {
		d.released = true
		err = d.lock.release()
	}
	d.mu.Unlock()
	d.wg.Wait()
	return err
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
		if !sockfile.IsTempName(e.Name()) || e.Type() != fs.ModeSocket {
			continue
		}
		p := filepath.Join(dir, e.Name())
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			log.Warn("remove leftover temporary socket", "path", p, "err", err)
		}
	}
}
