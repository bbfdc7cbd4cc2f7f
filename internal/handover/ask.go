package handover

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"

	"golang.org/x/sys/unix"
)

// Ask asks the holder of dir for a hand-over, for a new instance that configures the drivers
// named own. On success it returns what the holder handed over and the directory's lock, an
// open file that checkLock accepted (before the new instance acknowledges). Otherwise it
// returns an error and what it received, if anything: the drivers of every batch received
// whole before the error (a protocol error in one message costs that message's drivers only),
// or every batch once it acknowledged. The caller waits for the lock, and serves the sockets
// that are still the files at their paths if it gets it (the holder ended). With nothing
// received, snap is nil.
//
// It accepts what own can use (bounds.go): of a driver own does not name, it keeps the sockets
// alone, for the caller to withdraw; one with none it does not keep. A holder that hands over
// more than that is out of protocol. It logs one line of what it received, whatever the number
// of drivers.
//
// Of the listening sockets the holder hands over (version 2 on), it keeps those that serves
// names, by name and address, and that belong to this process's network namespace (the host's
// network, which both pods share; not another pod's), and its acknowledgement names them: the
// holder serves those no more.
func Ask(dir string, log *slog.Logger, checkLock func(*os.File) error, own []string, serves []ListenerSpec) (snap *Snapshot, lock *os.File, err error) {
	hc, err := Dial(dir)
	if err != nil {
		return nil, nil, fmt.Errorf("no instance answers hand-over requests (an older multireg, or one that is stopping): %w", err)
	}
	defer hc.c.Close()
	lo, hi := protocolRange()
	if err := hc.Send(&Msg{Type: MsgHello, MinVersion: lo, Version: hi}); err != nil {
		return nil, nil, err
	}
	halt(log, "new", "hello")
	snap = &Snapshot{}
	in := newIntake(own)
	defer in.log(log)
	// kept is what the caller keeps after an error: snap, if it holds anything.
	kept := func() *Snapshot {
		if snap.Len() == 0 {
			return nil
		}
		return snap
	}
	// abort ends the hand-over on the holder's message that breaks the protocol: the
	// message's descriptors are closed, the holder is told why (it serves again at once), and
	// the batches received before are kept.
	abort := func(files []*os.File, err error) (*Snapshot, *os.File, error) {
		CloseAll(files)
		hc.Send(&Msg{Type: MsgAbort, Reason: err.Error()})
		return kept(), nil, fmt.Errorf("hand-over: %w", err)
	}
	var lockF *os.File
	v := 0                          // the version the holder picked
	buf := make([]byte, maxMessage) // every message is read into it
	for lockF == nil {
		m, files, size, err := hc.recv(buf, hc.stepTimeout())
		if err != nil {
			return kept(), nil, fmt.Errorf("hand-over interrupted: %w", err)
		}
		switch {
		case m.Type == MsgRefuse:
			CloseAll(files)
			return kept(), nil, fmt.Errorf("hand-over refused: %s", m.Reason)
		case m.Type == MsgWelcome && v == 0 && m.Version >= takeVersion && m.Version >= lo && m.Version <= hi:
			// Version 2 on: the holder stops its loops once told to take.
			CloseAll(files)
			v = m.Version
			if err := hc.Send(&Msg{Type: MsgTake, Version: v}); err != nil {
				return nil, nil, fmt.Errorf("hand-over interrupted: %w", err)
			}
			halt(log, "new", "take")
			continue
		case m.Type == MsgBatch && v == 0 && m.Version >= lo && m.Version < takeVersion:
			// Version 1: the batches follow the hello.
		case m.Type == MsgBatch && v != 0 && m.Version == v:
		case v == 0:
			return abort(files, fmt.Errorf("unexpected %q in version %d (this instance speaks %d to %d)", m.Type, m.Version, lo, hi))
		default:
			return abort(files, fmt.Errorf("unexpected %q in version %d after version %d", m.Type, m.Version, v))
		}
		v = m.Version
		if m.Last != m.Lock {
			return abort(files, errors.New("batch: the lock comes with the last batch, and only then"))
		}
		if err := fill(m, files); err != nil {
			return abort(nil, err) // fill closed them
		}
		if err := in.admit(m, size); err != nil {
			return abort(files, err)
		}
		for _, hd := range m.Drivers {
			in.keep(snap, hd, dir)
		}
		if !m.Last {
			halt(log, "new", "batch", "drivers", len(m.Drivers))
			continue
		}
		for _, l := range listenersOf(m, files, serves, log) {
			snap.AddListener(l)
		}
		lockF = files[len(files)-1]
	}
	if err := holdsLock(lockF, dir, checkLock); err != nil {
		return abort([]*os.File{lockF}, err)
	}
	halt(log, "new", "received")
	// From here, a failure leaves both sides unsure whether the other holds the lock: each
	// lets go of its copy and locks anew, and the sockets go to whoever gets it.
	if err := hc.Send(&Msg{Type: MsgAck, Version: v, Listeners: snap.ListenerSpecs()}); err != nil {
		lockF.Close()
		return snap, nil, err
	}
	halt(log, "new", "acked")
	m, files, err := hc.Recv()
	CloseAll(files)
	if err == nil && m.Type != MsgReleased {
		err = fmt.Errorf("unexpected %q", m.Type)
	}
	if err != nil {
		lockF.Close()
		return snap, nil, fmt.Errorf("hand-over: no release from the previous instance: %w", err)
	}
	return snap, lockF, nil
}

// fill gives the batch's drivers their descriptors, in order, then its listeners theirs; the
// lock's comes last.
func fill(m *Msg, files []*os.File) error {
	if len(m.Listeners) > 0 && (!m.Last || m.Version < listenersVersion || len(m.Listeners) > maxListeners) {
		CloseAll(files)
		return fmt.Errorf("batch: %d listeners in version %d (the last batch carries %d at most, from version %d on)",
			len(m.Listeners), m.Version, maxListeners, listenersVersion)
	}
	want := m.Sockets + len(m.Listeners)
	if m.Lock {
		want++
	}
	n := 0
	for _, hd := range m.Drivers {
		if hd == nil || slices.Contains(hd.Sockets, nil) {
			CloseAll(files)
			return errors.New("batch: an empty driver or socket")
		}
		n += len(hd.Sockets)
	}
	if len(files) != want || n != m.Sockets {
		CloseAll(files)
		return fmt.Errorf("batch: %d descriptors for %d sockets", len(files), n)
	}
	i := 0
	for _, hd := range m.Drivers {
		for _, hs := range hd.Sockets {
			hs.File = files[i]
			i++
		}
	}
	return nil
}

// listenersOf are the listeners of the last batch m, with their descriptors (which follow the
// sockets'); one that is not a listening TCP socket is closed and left out.
func listenersOf(m *Msg, files []*os.File, serves []ListenerSpec, log *slog.Logger) []*HandedListener {
	var out []*HandedListener
	for i, spec := range m.Listeners {
		f := files[m.Sockets+i]
		if !slices.Contains(serves, spec) {
			log.Info("a listener handed over is not one this instance serves; the previous instance goes on serving it", "name", spec.Name, "addr", spec.Addr)
			f.Close()
			continue
		}
		err := isListeningTCP(f)
		if err == nil {
			err = inNetns(f)
		}
		if errors.Is(err, errOtherNetns) { // the pod network: each pod serves its own
			log.Info("a listener handed over is of another network namespace; each instance serves its own", "name", spec.Name, "addr", spec.Addr)
			f.Close()
			continue
		}
		if err != nil {
			log.Warn("a listener handed over is not taken; the new instance binds its own", "name", spec.Name, "addr", spec.Addr, "err", err)
			f.Close()
			continue
		}
		out = append(out, &HandedListener{ListenerSpec: spec, File: f})
	}
	return out
}

// holdsLock checks that f, received as the directory's lock, is what checkLock accepts and
// holds the lock: it locks f without waiting. That succeeds on the holder's own open file,
// which holds the lock already, and fails on any other open of the lock file while the holder
// holds its own.
func holdsLock(f *os.File, dir string, checkLock func(*os.File) error) error {
	if err := checkLock(f); err != nil {
		return err
	}
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var ferr error
	if err := rc.Control(func(fd uintptr) { ferr = unix.Flock(int(fd), unix.LOCK_EX|unix.LOCK_NB) }); err != nil {
		return err
	}
	if ferr != nil {
		return fmt.Errorf("the lock descriptor handed over does not hold the lock of the registration directory %s: %w", dir, ferr)
	}
	return nil
}
