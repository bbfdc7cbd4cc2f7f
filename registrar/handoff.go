package registrar

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"slices"
	"time"
)

// The two sides of a hand-over (handover.go): the holder of the directory (Dir.handOver) and
// the new instance (askHandover).

// Handoff is what the holder's side of a hand-over needs of its drivers: *Supervisor.
type Handoff interface {
	// Detach stops every loop and returns what they hand over; reloads wait.
	Detach() *Snapshot
	// Resume runs the loops again from what Detach returned (the hand-over failed).
	Resume(*Snapshot)
	// Release ends a hand-over that succeeded: nothing runs again.
	Release()
}

// HandedOver is how Dir.Run ends when the directory went to a new instance by a hand-over:
// the process serves nothing more. Snapshot holds this process's copies of the sockets it
// handed over, and what their loops stood at.
type HandedOver struct {
	Snapshot *Snapshot
	Took     time.Duration // from the request to the release
}

func (e *HandedOver) Error() string {
	return "handed the registration directory over to a new instance"
}

// Message types.
const (
	msgHello    = "hello"
	msgRefuse   = "refuse"
	msgBatch    = "batch"
	msgAck      = "ack"
	msgAbort    = "abort"
	msgReleased = "released"
)

// handOver serves one hand-over request on c, with the supervisor h. It returns a *HandedOver
// when the directory went to the new instance, and nil when this process keeps it: its loops
// run again from where they stopped.
func (d *Dir) handOver(c *net.UnixConn, h Handoff) error {
	defer c.Close()
	hc := handoverConn{c: c}
	log := d.log
	if err := sameUser(c); err != nil {
		log.Warn("hand-over request refused", "err", err)
		return nil
	}
	m, files, err := hc.recv()
	closeAll(files)
	if err != nil || m.Type != msgHello {
		log.Warn("hand-over request not understood; ignored", "err", err)
		return nil
	}
	v := pickVersion(m.MinVersion, m.Version)
	if v == 0 {
		lo, hi := protocolRange()
		why := fmt.Sprintf("this instance speaks hand-over versions %d to %d, the new one %d to %d", lo, hi, m.MinVersion, m.Version)
		hc.send(&handoverMsg{Type: msgRefuse, Reason: why})
		log.Warn("hand-over refused; the new instance waits for this one to exit", "why", why)
		return nil
	}
	start := time.Now()
	snap := h.Detach()
	log.Info("handing over the registration directory to a new instance", "drivers", snap.Len(), "sockets", snap.Sockets(), "version", v)
	halt(log, "holder", "detached")
	lockSent, err := d.sendSnapshot(hc, snap, v)
	if err == nil {
		var reply *handoverMsg
		reply, files, err = hc.recv()
		closeAll(files)
		switch {
		case err != nil:
		case reply.Type == msgAbort:
			err = fmt.Errorf("the new instance gave up: %s", reply.Reason)
		case reply.Type != msgAck:
			err = fmt.Errorf("unexpected %q", reply.Type)
		}
	}
	if err == nil {
		d.let()
		halt(log, "holder", "released")
		if err := hc.send(&handoverMsg{Type: msgReleased, Version: v}); err != nil {
			log.Warn("could not tell the new instance the directory is released; it finds out by itself", "err", err)
		}
		h.Release()
		took := time.Since(start)
		log.Info("handed over the registration directory; this instance serves nothing now and exits on SIGTERM",
			"drivers", snap.Len(), "sockets", snap.Sockets(), "took", took.Round(time.Millisecond).String())
		return &HandedOver{Snapshot: snap, Took: took}
	}
	log.Warn("hand-over failed", "err", err)
	if lockSent && !d.retake() {
		h.Release()
		log.Warn("the new instance holds the registration directory's lock: it serves; this instance serves nothing now")
		return &HandedOver{Snapshot: snap, Took: time.Since(start)}
	}
	h.Resume(snap)
	log.Info("hand-over failed; this instance goes on serving every driver")
	return nil
}

// sendSnapshot sends snap in batches, the lock's descriptor with the last one. It reports
// whether the lock's descriptor was sent (even when the send then failed).
func (d *Dir) sendSnapshot(hc handoverConn, snap *Snapshot, v int) (lockSent bool, err error) {
	var drivers []*handedDriver
	for _, hd := range snap.drivers {
		drivers = append(drivers, hd)
	}
	lockF := d.lockFile()
	bs := batches(drivers)
	for i, batch := range bs {
		last := i == len(bs)-1
		m := &handoverMsg{Type: msgBatch, Version: v, Drivers: batch, Last: last, Lock: last}
		var files []*os.File
		for _, hd := range batch {
			for _, hs := range hd.Sockets {
				files = append(files, hs.f)
			}
		}
		m.Sockets = len(files)
		if last {
			files = append(files, lockF)
		}
		if err := hc.send(m, files...); err != nil {
			return last, err
		}
		if !last {
			halt(d.log, "holder", "batch", "drivers", len(batch))
		}
	}
	return true, nil
}

// batches cuts drivers into the batches of a hand-over: at most handoverBatch drivers and about
// maxBatchBytes of JSON each (a message on a SOCK_SEQPACKET socket must fit the socket's send
// buffer whole), and at least one batch, which may be empty.
func batches(drivers []*handedDriver) [][]*handedDriver {
	var out [][]*handedDriver
	var cur []*handedDriver
	size := 0
	for _, hd := range drivers {
		b, _ := json.Marshal(hd)
		if len(cur) > 0 && (len(cur) == handoverBatch || size+len(b) > maxBatchBytes) {
			out = append(out, cur)
			cur, size = nil, 0
		}
		cur = append(cur, hd)
		size += len(b)
	}
	return append(out, cur)
}

// askHandover asks the holder of dir for a hand-over. On success it returns what the holder
// handed over and the directory's lock. Otherwise it returns an error and the sockets it
// received, if any: the caller waits for the lock, and serves those that are still the files
// at their paths if it gets it (the holder died). Refused, or with nothing received, snap is
// nil.
func askHandover(dir string, log *slog.Logger) (snap *Snapshot, lock *dirLock, err error) {
	hc, err := dialHandover(dir)
	if err != nil {
		return nil, nil, fmt.Errorf("no instance answers hand-over requests (an older multireg, or one that is stopping): %w", err)
	}
	defer hc.c.Close()
	lo, hi := protocolRange()
	if err := hc.send(&handoverMsg{Type: msgHello, MinVersion: lo, Version: hi}); err != nil {
		return nil, nil, err
	}
	halt(log, "new", "hello")
	snap = &Snapshot{}
	var lockF *os.File
	v := 0 // the version the holder picked
	for lockF == nil {
		m, files, err := hc.recv()
		if err != nil {
			return snap, nil, fmt.Errorf("hand-over interrupted: %w", err)
		}
		switch m.Type {
		case msgRefuse:
			closeAll(files)
			snap.Close()
			return nil, nil, fmt.Errorf("hand-over refused: %s", m.Reason)
		case msgBatch:
		default:
			closeAll(files)
			snap.Close()
			return nil, nil, fmt.Errorf("hand-over: unexpected %q", m.Type)
		}
		v = m.Version
		if m.Last != m.Lock {
			closeAll(files)
			err := fmt.Errorf("hand-over batch: the lock comes with the last batch, and only then")
			hc.send(&handoverMsg{Type: msgAbort, Reason: err.Error()})
			snap.Close()
			return nil, nil, err
		}
		if err := fill(m, files); err != nil {
			hc.send(&handoverMsg{Type: msgAbort, Reason: err.Error()})
			snap.Close()
			return nil, nil, err
		}
		for _, hd := range m.Drivers {
			snap.add(hd)
		}
		if !m.Last {
			halt(log, "new", "batch", "drivers", len(m.Drivers))
			continue
		}
		lockF = files[len(files)-1]
	}
	if err := lockFileOf(lockF, dir); err != nil {
		hc.send(&handoverMsg{Type: msgAbort, Reason: err.Error()})
		lockF.Close()
		snap.Close()
		return nil, nil, fmt.Errorf("hand-over: %w", err)
	}
	halt(log, "new", "received")
	// From here, a failure leaves both sides unsure whether the other holds the lock: each
	// lets go of its copy and locks anew, and the sockets go to whoever gets it.
	if err := hc.send(&handoverMsg{Type: msgAck, Version: v}); err != nil {
		lockF.Close()
		return snap, nil, err
	}
	halt(log, "new", "acked")
	m, files, err := hc.recv()
	closeAll(files)
	if err == nil && m.Type != msgReleased {
		err = fmt.Errorf("unexpected %q", m.Type)
	}
	if err != nil {
		lockF.Close()
		return snap, nil, fmt.Errorf("hand-over: no release from the previous instance: %w", err)
	}
	return snap, &dirLock{dir: dir, f: lockF}, nil
}

// fill gives the batch's drivers their descriptors, in order; the lock's comes last.
func fill(m *handoverMsg, files []*os.File) error {
	want := m.Sockets
	if m.Lock {
		want++
	}
	n := 0
	for _, hd := range m.Drivers {
		if hd == nil || slices.Contains(hd.Sockets, nil) {
			closeAll(files)
			return errors.New("hand-over batch: an empty driver or socket")
		}
		n += len(hd.Sockets)
	}
	if len(files) != want || n != m.Sockets {
		closeAll(files)
		return fmt.Errorf("hand-over batch: %d descriptors for %d sockets", len(files), n)
	}
	i := 0
	for _, hd := range m.Drivers {
		for _, hs := range hd.Sockets {
			hs.f = files[i]
			i++
		}
	}
	return nil
}
