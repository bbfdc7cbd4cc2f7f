package handover

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/sockfile"
)

// Snapshot is what one instance hands the next: for each driver, its
// configuration, its listening registration sockets and where its loop stands. A Supervisor
// given one (TakeOver) serves those sockets for every driver that registers as it did
// (Driver.RegistersAs: its config.Registration is unchanged),
// so that kubelet sees nothing. Whoever holds a Snapshot owns its descriptors until Close.
type Snapshot struct {
	drivers map[string]*Driver
	// listeners are the listening TCP sockets handed over beside the drivers' (version 2 on).
	listeners []*HandedListener
}

// HandedListener is a listening TCP socket handed over: --http-endpoint's, the drivers' health
// endpoints'.
type HandedListener struct {
	ListenerSpec
	// File is the listening socket; nil once taken. Its owner closes it.
	File *os.File
}

// AddListener puts l in s, which owns its descriptor from now on.
func (s *Snapshot) AddListener(l *HandedListener) {
	s.listeners = append(s.listeners, l)
}

// TakeListeners removes from s, and returns, the listeners of spec (its name and address as
// the flag gives it): the caller owns them.
func (s *Snapshot) TakeListeners(spec ListenerSpec) []*os.File {
	if s == nil {
		return nil
	}
	var out []*os.File
	s.listeners = slices.DeleteFunc(s.listeners, func(l *HandedListener) bool {
		if l.ListenerSpec != spec || l.File == nil {
			return false
		}
		out = append(out, l.File)
		return true
	})
	return out
}

// ListenerSpecs names the listeners s holds, once each.
func (s *Snapshot) ListenerSpecs() []ListenerSpec {
	var out []ListenerSpec
	for _, l := range s.listeners {
		if !slices.Contains(out, l.ListenerSpec) {
			out = append(out, l.ListenerSpec)
		}
	}
	return out
}

// sentListeners is what of named s holds: the listeners a new instance says it took, of those
// it was sent.
func (s *Snapshot) sentListeners(named []ListenerSpec) []ListenerSpec {
	held := s.ListenerSpecs()
	var out []ListenerSpec
	for _, spec := range named {
		if slices.Contains(held, spec) && !slices.Contains(out, spec) {
			out = append(out, spec)
		}
	}
	return out
}

// DropListeners closes the listeners s still holds.
func (s *Snapshot) DropListeners() {
	if s == nil {
		return
	}
	for _, l := range s.listeners {
		if l.File != nil {
			l.File.Close()
		}
	}
	s.listeners = nil
}

// Driver is one driver's part of a hand-over: enough for its loop to go on exactly
// where the other instance's stood. A batch carries it as wire.go says.
type Driver struct {
	// Spec is the driver as the handing instance ran it: the new instance serves the sockets
	// only when its own configuration registers the driver the same way (RegistersAs). Of a
	// driver received, the fields the predecessor did not send are zero (unsent).
	Spec config.Driver
	// Endpoint and LocalEndpoint: the target the loop registered (a pattern's match).
	Endpoint      string
	LocalEndpoint string
	// EndpointID is the endpoint's socket as last probed: another one means the driver
	// restarted meanwhile.
	EndpointID fsid.ID
	// NodeInfo is a CSI driver's NodeGetInfo answer recorded at registration (protobuf).
	NodeInfo []byte
	// Status is where the loop stood.
	Status Status
	// Timeout is the registration timeout in force; 0: the receiver's own. Failures is how
	// many failures the backoff has counted since it was last reset.
	Timeout  time.Duration
	Failures int
	Sockets  []*Socket
	// unsent: the fields deciding a registration that the predecessor did not send.
	unsent unsent
}

// Status is where a driver's loop stood: what its status says, as the next loop takes it on.
// Fields a predecessor did not send are zero: an empty Phase, a zero Since (the receiver
// decides them from the sockets it serves).
type Status struct {
	Phase      string
	Socket     string
	EndpointUp bool
	Absent     bool
	// Attempts, Failures, Results, Recreations and EndpointRestarts are the loop's counters.
	Attempts         int
	Failures         int
	Results          map[string]int
	Recreations      map[string]int
	EndpointRestarts int
	HeldByOther      bool
	// LastError is cut short on the wire (maxLastError).
	LastError   string
	Since       time.Time
	NextAttempt time.Time
}

// Socket is one listening registration socket.
type Socket struct {
	// Prev: the previous generation of an endpoint's rollover to a new instance (a DRA
	// driver's or a device plugin's second socket), kept until its successor is registered.
	Prev       bool
	Path       string
	ID         fsid.ID
	Generation uint64
	Registered bool
	// AwaitsVerdict: kubelet asked GetInfo and its verdict has not come: it may reach the new
	// instance, on a connection of its own.
	AwaitsVerdict bool
	Endpoint      string
	LocalEndpoint string
	// Versions are the supportedVersions the socket's GetInfo answers (the driver's, and the
	// health services detected). nil: the configured ones.
	Versions []string

	// File is the listening socket; nil once taken. Its owner closes it.
	File *os.File
	// Own: the socket is this process's own (its loops handed it over, and run again from it
	// after a hand-over that failed, or after the successor ended): no predecessor vouches
	// for it, so Check need not connect to it.
	Own bool
}

// Len is the number of drivers in s.
func (s *Snapshot) Len() int {
	if s == nil {
		return 0
	}
	return len(s.drivers)
}

// Sockets is the number of sockets s holds.
func (s *Snapshot) Sockets() int {
	return s.count(func(*Socket) bool { return true })
}

// Alive is the number of sockets of s that are still the files at their paths.
func (s *Snapshot) Alive() int {
	return s.count(func(hs *Socket) bool { return socketAt(hs.Path, hs.ID) == nil })
}

// count is the number of sockets s holds for which ok holds.
func (s *Snapshot) count(ok func(*Socket) bool) int {
	if s == nil {
		return 0
	}
	n := 0
	for _, h := range s.drivers {
		for _, hs := range h.Sockets {
			if hs.File != nil && ok(hs) {
				n++
			}
		}
	}
	return n
}

// Close closes every descriptor s still holds. A nil Snapshot closes nothing.
func (s *Snapshot) Close() {
	if s == nil {
		return
	}
	for _, h := range s.drivers {
		h.Close()
	}
	s.drivers = nil
	s.DropListeners()
}

// Take removes the named driver from s and returns it, or nil.
func (s *Snapshot) Take(name string) *Driver {
	if s == nil {
		return nil
	}
	h := s.drivers[name]
	delete(s.drivers, name)
	return h
}

// Close closes the descriptors h still holds.
func (h *Driver) Close() {
	for _, hs := range h.Sockets {
		if hs.File != nil {
			hs.File.Close()
			hs.File = nil
		}
	}
}

// SentIn are h's sockets that a batch of hand-over version v carries: those a receiver of
// that version serves. Version 1 is v0.1.0's, which gives a driver a second registration path
// only when its endpoint is a pattern, and no third: a socket at a DRA driver's second path
// (its endpoint fixed) or at a device plugin's third is one it refuses, and leaves in place.
func (h *Driver) SentIn(v int) []*Socket {
	if v >= 2 {
		return h.Sockets
	}
	var out []*Socket
	for _, hs := range h.Sockets {
		if hs.Path != altPathV1(h.Spec) && slices.Contains(h.Spec.SocketPaths()[1:], hs.Path) {
			continue
		}
		out = append(out, hs)
	}
	return out
}

// Unsent removes from s, and returns in a Snapshot of their own, the sockets a hand-over in
// version v did not carry (Driver.SentIn): after the hand-over, they are this process's to
// withdraw, or kubelet would keep a registration of a socket nobody serves.
func (s *Snapshot) Unsent(v int) *Snapshot {
	out := &Snapshot{}
	if s == nil {
		return out
	}
	for _, h := range s.drivers {
		sent := h.SentIn(v)
		if len(sent) == len(h.Sockets) {
			continue
		}
		rest := *h
		rest.Sockets = slices.DeleteFunc(slices.Clone(h.Sockets), func(hs *Socket) bool { return slices.Contains(sent, hs) })
		h.Sockets = sent
		out.Add(&rest)
	}
	return out
}

// TakeAll removes every driver from s and returns them.
func (s *Snapshot) TakeAll() []*Driver {
	if s == nil {
		return nil
	}
	ds := make([]*Driver, 0, len(s.drivers))
	for _, h := range s.drivers {
		ds = append(ds, h)
	}
	s.drivers = nil
	return ds
}

// Add puts h in s, replacing (and closing) an older part for the same driver.
func (s *Snapshot) Add(h *Driver) {
	if s.drivers == nil {
		s.drivers = map[string]*Driver{}
	}
	if old := s.drivers[h.Spec.Name]; old != nil {
		old.Close()
	}
	s.drivers[h.Spec.Name] = h
}

// Merge moves every driver of o into s, o's parts winning, and o's listeners.
func (s *Snapshot) Merge(o *Snapshot) {
	if o == nil {
		return
	}
	for _, h := range o.drivers {
		s.Add(h)
	}
	o.drivers = nil
	s.listeners = append(s.listeners, o.listeners...)
	o.listeners = nil
}

// keepInside drops from h, closing their descriptors, the sockets whose path is not a
// registration socket's in dir: a file of dir's own (not hidden, as kubelet would ignore it
// and as multireg's own files are). Nothing at such a path is multireg's to serve or remove.
// It returns how many it dropped, and why it dropped the first.
func keepInside(h *Driver, dir string) (dropped int, why error) {
	kept := h.Sockets[:0]
	for _, hs := range h.Sockets {
		if err := insideDir(hs.Path, dir); err != nil {
			if why == nil {
				why = fmt.Errorf("%s: %w", hs.Path, err)
			}
			dropped++
			hs.File.Close()
			continue
		}
		kept = append(kept, hs)
	}
	clear(h.Sockets[len(kept):])
	h.Sockets = kept
	return dropped, why
}

// insideDir checks that path names a file of the directory dir, not hidden.
func insideDir(path, dir string) error {
	name := filepath.Base(path)
	if !filepath.IsAbs(path) || name == "." || name == "/" || strings.HasPrefix(name, ".") {
		return fmt.Errorf("not a registration socket's name (absolute, not hidden)")
	}
	a, err := os.Stat(filepath.Dir(path))
	if err != nil {
		return err
	}
	b, err := os.Stat(dir)
	if err != nil {
		return err
	}
	if !os.SameFile(a, b) {
		return fmt.Errorf("not in the registration directory %s", dir)
	}
	return nil
}

// Withdraw removes the sockets of a handed driver that no loop takes over (removed from the
// configuration, or registering differently now), as a reload would remove them: each only if
// it is still the socket handed over (Check: the descriptor is the socket bound there). Ask
// kept only sockets of the registration directory. It logs a line for each socket.
func (h *Driver) Withdraw(log *slog.Logger) {
	h.withdraw(log)
}

// withdrawal is what became of the sockets withdrawn (Driver.withdraw).
type withdrawal struct {
	// removed: kubelet deregisters their drivers. leftAlone: no longer the socket handed over
	// (replaced, gone), or not the one bound at its path. failed: could not be removed.
	removed, leftAlone, failed int
	why                        error // why the first socket not removed was not
}

func (w *withdrawal) add(o withdrawal) {
	w.removed, w.leftAlone, w.failed = w.removed+o.removed, w.leftAlone+o.leftAlone, w.failed+o.failed
	if w.why == nil {
		w.why = o.why
	}
}

// withdraw is Withdraw, logging a line for each socket only when log is not nil; it says what
// became of them.
func (h *Driver) withdraw(log *slog.Logger) (w withdrawal) {
	note := func(path string, err error) {
		if w.why == nil {
			w.why = fmt.Errorf("%s: %w", path, err)
		}
	}
	for _, hs := range h.Sockets {
		if hs.File == nil {
			continue
		}
		err := hs.Check()
		hs.File.Close()
		hs.File = nil
		if err != nil {
			w.leftAlone++
			note(hs.Path, err)
			if log != nil {
				log.Info("a handed-over socket no driver takes is left alone: it is not the socket handed over", "socket", hs.Path, "err", err)
			}
			continue
		}
		removed, err := sockfile.RemoveIfOurs(hs.Path, hs.ID)
		switch {
		case err != nil:
			w.failed++
			note(hs.Path, err)
			if log != nil {
				log.Warn("remove registration socket", "socket", hs.Path, "err", err)
			}
		case removed:
			w.removed++
			if log != nil {
				log.Info("registration socket removed; kubelet deregisters the plugin", "socket", hs.Path)
			}
		default:
			w.leftAlone++
			note(hs.Path, errors.New("no longer the socket handed over"))
		}
	}
	return w
}

// perDriverLines is how many drivers' withdrawals Snapshot.Withdraw logs one by one; more are
// summed up in one line.
const perDriverLines = 8

// Withdraw removes the sockets of every driver s holds, as Driver.Withdraw does, and empties s:
// what a hand-over brought that no loop took over, once the configuration is applied (drivers
// no longer configured). With perDriverLines drivers or fewer that have sockets, each says what
// became of its sockets, a line for each; with more, one line says it for all: how many sockets
// were removed, left alone and not removed, why the first was not, and the first drivers'
// names.
func (s *Snapshot) Withdraw(log *slog.Logger) {
	s.withdraw(log, "withdrew the handed-over sockets of drivers no longer configured; kubelet deregisters those removed")
}

// withdraw is Withdraw, its line for many drivers saying summary.
func (s *Snapshot) withdraw(log *slog.Logger, summary string) {
	var ds []*Driver
	for _, h := range s.TakeAll() {
		if slices.ContainsFunc(h.Sockets, func(hs *Socket) bool { return hs.File != nil }) {
			ds = append(ds, h)
		}
	}
	slices.SortFunc(ds, func(a, b *Driver) int { return strings.Compare(a.Spec.Name, b.Spec.Name) })
	if len(ds) <= perDriverLines {
		for _, h := range ds {
			h.Withdraw(log.With("driver", h.Spec.Name))
		}
		return
	}
	var w withdrawal
	var first []string
	for _, h := range ds {
		w.add(h.withdraw(nil))
		if len(first) < 3 {
			first = append(first, h.Spec.Name)
		}
	}
	attrs := []any{"drivers", len(ds), "removed", w.removed, "leftAlone", w.leftAlone, "notRemoved", w.failed,
		"first", strings.Join(first, ", ") + ", …"}
	if w.why != nil {
		attrs = append(attrs, "why", w.why)
	}
	level := slog.LevelInfo
	if w.failed > 0 {
		level = slog.LevelWarn
	}
	log.Log(context.Background(), level, summary, attrs...)
}

// Check checks that hs's descriptor is a listening unix stream socket, that the file at its
// path has the identity handed over, and that the descriptor is the socket bound to that file:
// a connection to the path reaches it (boundAt).
func (hs *Socket) Check() error {
	if hs.File == nil {
		return errors.New("no descriptor")
	}
	if err := isListeningUnixStream(hs.File); err != nil {
		return err
	}
	if err := socketAt(hs.Path, hs.ID); err != nil {
		return err
	}
	if hs.Own {
		return nil
	}
	return boundAt(hs.File, hs.Path)
}

// isListeningUnixStream checks that f is a listening unix stream socket.
func isListeningUnixStream(f *os.File) error {
	return isListening(f, unix.AF_UNIX, "not a listening unix stream socket")
}

// isListeningTCP checks that f is a listening TCP socket (IPv4 or IPv6).
func isListeningTCP(f *os.File) error {
	if err := isListening(f, unix.AF_INET, ""); err == nil {
		return nil
	}
	return isListening(f, unix.AF_INET6, "not a listening TCP socket")
}

// inNetns checks that f, a TCP socket, belongs to this process's network namespace: that its
// inode is among the TCP sockets /proc/self/net lists (which needs no privilege, unlike
// SIOCGSKNS, and no kernel newer than 4.x, unlike SO_NETNS_COOKIE).
func inNetns(f *os.File) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var st unix.Stat_t
	var serr error
	if err := rc.Control(func(fd uintptr) { serr = unix.Fstat(int(fd), &st) }); err != nil {
		return err
	}
	if serr != nil {
		return serr
	}
	ino := strconv.FormatUint(st.Ino, 10)
	for _, table := range []string{"/proc/self/net/tcp", "/proc/self/net/tcp6"} {
		b, err := os.ReadFile(table)
		if errors.Is(err, fs.ErrNotExist) {
			continue // no IPv6
		}
		if err != nil {
			return err
		}
		for line := range strings.Lines(string(b)) {
			// sl local rem st queues tr retrnsmt uid timeout inode ...
			if fields := strings.Fields(line); len(fields) > 9 && fields[9] == ino {
				return nil
			}
		}
	}
	return errOtherNetns
}

// errOtherNetns: a listener handed over belongs to another network namespace: the two pods
// are on the pod network, each with its own socket (not a fault: the holder keeps serving it).
var errOtherNetns = errors.New("a socket of another network namespace (the previous pod's own network)")

// isListening checks that f is a listening stream socket of domain, or says what.
func isListening(f *os.File, domain int, what string) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var typ, acc, dom int
	var e1, e2, e3 error
	if err := rc.Control(func(fd uintptr) {
		typ, e1 = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_TYPE)
		acc, e2 = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_ACCEPTCONN)
		dom, e3 = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_DOMAIN)
	}); err != nil {
		return err
	}
	// Each option read fails alike on a descriptor that is not a socket: the first says why.
	if err := cmp.Or(e1, e2, e3); err != nil {
		return fmt.Errorf("not a socket: %w", err)
	}
	if dom != domain || typ != unix.SOCK_STREAM || acc != 1 {
		return errors.New(what)
	}
	return nil
}

// socketAt checks that the file at path is the socket with identity id.
func socketAt(path string, id fsid.ID) error {
	cur, mode, err := fsid.Stat(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("%s is gone", path)
	case err != nil:
		return err
	case mode != fs.ModeSocket || cur != id:
		return fmt.Errorf("%s is no longer the socket handed over", path)
	}
	return nil
}
