package handover

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"os"
	"time"
)

// The holder's side of a hand-over (Serve); the new instance's is Ask.

// Holder is what the holder's side of a hand-over needs of its drivers (multireg's
// supervisor): a snapshot out, and back in (Resume) when the hand-over fails.
type Holder interface {
	// Detach stops every loop and returns what they hand over; reloads wait.
	Detach() *Snapshot
	// Resume runs the loops again from what Detach returned (the hand-over failed).
	Resume(*Snapshot)
	// Release ends a hand-over that succeeded: nothing runs again.
	Release()
}

// Lock is what the holder's side of a hand-over needs of the directory's lock.
type Lock interface {
	// File is the lock's open file, passed to the new instance.
	File() *os.File
	// Let lets go of the lock after a hand-over: the new instance holds the same open file.
	Let()
	// Retake, after a hand-over that failed once the lock's descriptor was passed, lets go of
	// this process's copy and locks the directory anew. It reports whether this process
	// holds the directory again.
	Retake() bool
}

// HandedOver is how Serve (and the directory's Run) ends when the directory went to a new
// instance by a hand-over: the process serves nothing more. Snapshot holds this process's
// copies of the sockets it handed over, and what their loops stood at.
type HandedOver struct {
	Snapshot *Snapshot
	Took     time.Duration // from the request to the release
}

func (e *HandedOver) Error() string {
	return "handed the registration directory over to a new instance"
}

// Message types.
const (
	MsgHello    = "hello"
	MsgRefuse   = "refuse"
	MsgBatch    = "batch"
	MsgAck      = "ack"
	MsgAbort    = "abort"
	MsgReleased = "released"
)

// Serve serves one hand-over request on c, with the drivers h and the lock. It returns a
// *HandedOver when the directory went to the new instance, and nil when this process keeps it:
// its loops run again from where they stopped.
func Serve(c *net.UnixConn, h Holder, lock Lock, log *slog.Logger) error {
	defer c.Close()
	hc := Conn{c: c}
	if err := sameUser(c); err != nil {
		log.Warn("hand-over request refused", "err", err)
		return nil
	}
	m, files, err := hc.Recv()
	CloseAll(files)
	if err != nil || m.Type != MsgHello {
		log.Warn("hand-over request not understood; ignored", "err", err)
		return nil
	}
	v := pickVersion(m.MinVersion, m.Version)
	if v == 0 {
		lo, hi := protocolRange()
		why := fmt.Sprintf("this instance speaks hand-over versions %d to %d, the new one %d to %d", lo, hi, m.MinVersion, m.Version)
		hc.Send(&Msg{Type: MsgRefuse, Reason: why})
		log.Warn("hand-over refused; the new instance waits for this one to exit", "why", why)
		return nil
	}
	start := time.Now()
	snap := h.Detach()
	log.Info("handing over the registration directory to a new instance", "drivers", snap.Len(), "sockets", snap.Sockets(), "version", v)
	halt(log, "holder", "detached")
	lockSent, err := sendSnapshot(hc, snap, v, lock.File(), log)
	if err == nil {
		var reply *Msg
		reply, files, err = hc.Recv()
		CloseAll(files)
		switch {
		case err != nil:
		case reply.Type == MsgAbort:
			err = fmt.Errorf("the new instance gave up: %s", reply.Reason)
		case reply.Type != MsgAck:
			err = fmt.Errorf("unexpected %q", reply.Type)
		}
	}
	if err == nil {
		lock.Let()
		halt(log, "holder", "released")
		if err := hc.Send(&Msg{Type: MsgReleased, Version: v}); err != nil {
			log.Warn("could not tell the new instance the directory is released; it finds out by itself", "err", err)
		}
		h.Release()
		took := time.Since(start)
		log.Info("handed over the registration directory; this instance serves nothing now and exits on SIGTERM",
			"drivers", snap.Len(), "sockets", snap.Sockets(), "took", took.Round(time.Millisecond).String())
		return &HandedOver{Snapshot: snap, Took: took}
	}
	log.Warn("hand-over failed", "err", err)
	if lockSent && !lock.Retake() {
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
func sendSnapshot(hc Conn, snap *Snapshot, v int, lockF *os.File, log *slog.Logger) (lockSent bool, err error) {
	var drivers []*Driver
	for _, hd := range snap.drivers {
		drivers = append(drivers, hd)
	}
	bs := batches(drivers)
	for i, batch := range bs {
		last := i == len(bs)-1
		m := &Msg{Type: MsgBatch, Version: v, Drivers: batch, Last: last, Lock: last}
		var files []*os.File
		for _, hd := range batch {
			for _, hs := range hd.Sockets {
				files = append(files, hs.File)
			}
		}
		m.Sockets = len(files)
		if last {
			files = append(files, lockF)
		}
		if err := hc.Send(m, files...); err != nil {
			return last, err
		}
		if !last {
			halt(log, "holder", "batch", "drivers", len(batch))
		}
	}
	return true, nil
}

// batches cuts drivers into the batches of a hand-over: at most handoverBatch drivers and about
// maxBatchBytes of JSON each (a message on a SOCK_SEQPACKET socket must fit the socket's send
// buffer whole), and at least one batch, which may be empty.
func batches(drivers []*Driver) [][]*Driver {
	var out [][]*Driver
	var cur []*Driver
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
