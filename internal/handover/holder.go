package handover

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"sync"
	"syscall"
	"time"

	"multireg.dev/multireg/internal/throttle"
)

// The holder's side of a hand-over (Serve); the new instance's is Ask.

// Holder is what the holder's side of a hand-over needs of its drivers (multireg's
// supervisor): a snapshot out, and back in (Resume) when the hand-over fails.
type Holder interface {
	// HandOver stops every loop and returns what they hand over; reloads wait.
	HandOver() *Snapshot
	// Resume runs the loops again from what HandOver returned (the hand-over failed).
	Resume(*Snapshot)
	// Release ends a hand-over that succeeded: nothing runs again. The new instance serves
	// the listeners named (those of the snapshot it took): the holder serves them no more.
	Release(taken []ListenerSpec)
}

// Lock is what the holder's side of a hand-over needs of the directory's lock.
type Lock interface {
	// File is a descriptor of the lock's open file, passed to the new instance; the caller
	// closes it. A descriptor of its own, so that the lock's check, which may lock a new
	// lock file meanwhile and close the old one, never closes the one being sent.
	File() (*os.File, error)
	// Let lets go of the lock after a hand-over: the new instance holds the same open file.
	Let()
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
	MsgWelcome  = "welcome"
	MsgTake     = "take"
	MsgBatch    = "batch"
	MsgAck      = "ack"
	MsgAbort    = "abort"
	MsgReleased = "released"
)

// helloBytes bounds the read of a hello, a message of a few dozen bytes: requests are read
// concurrently, and a longer one is refused.
const helloBytes = 4 << 10

// Server is the holder's side of hand-overs: it serves each request on the caller's
// goroutine, so that requests are served concurrently (the caller bounds how many), and at
// most one hand-over at a time.
type Server struct {
	h    Holder
	lock Lock
	log  *slog.Logger
	t    Timeouts
	// guards: done, once the directory went to a new instance. Serve holds it for a whole
	// hand-over (from HandOver until Resume or the release, within the one call), and refuses
	// a second request while it is held.
	busy sync.Mutex
	done bool
	// noise throttles the warnings about requests that are not hand-overs (warn).
	noise throttle.Warning
}

// warn logs a warning about a request that is not a hand-over: the first, then one per
// throttle.Interval at most, saying how many were not; those go to the debug level.
func (s *Server) warn(msg string, args ...any) {
	log, n := s.noise.Note()
	if !log {
		s.log.Debug(msg, args...)
		return
	}
	if n > 1 {
		args = append(args, "alikeNotLogged", n-1)
	}
	s.log.Warn(msg, args...)
}

// NewServer returns the server of the holder's drivers h and its lock, its steps bounded by t.
func NewServer(h Holder, lock Lock, log *slog.Logger, t Timeouts) *Server {
	return &Server{h: h, lock: lock, log: log, t: t.orDefaults(), noise: throttle.Warning{Every: throttle.Interval}}
}

// Serve serves one hand-over request on c and closes it. It returns a *HandedOver when the
// directory went to the new instance, and nil when this process keeps it: its loops run
// again from where they stopped.
//
// Nothing stops before the new instance's hello, read within Timeouts.Hello, and (version 2
// on) its take, read within Timeouts.Hello of the welcome; from then on the loops stop for
// Timeouts.Pause at most. This process keeps its hold of the lock until the new
// instance acknowledges: one that does not, within Timeouts.Pause, cannot serve with the lock's
// descriptor it received (it serves only once told released), and this one serves again.
func (s *Server) Serve(c *net.UnixConn) error {
	defer c.Close()
	hc := Conn{c: c, step: s.t.Step}
	if err := sameUser(c); err != nil {
		s.warn("hand-over request refused", "err", err)
		return nil
	}
	m, err := hc.recvShort(MsgHello, s.t.Hello)
	if err != nil {
		s.warn("hand-over request not understood; ignored", "err", err)
		return nil
	}
	v := pickVersion(m.MinVersion, m.Version)
	if v == 0 {
		lo, hi := protocolRange()
		why := fmt.Sprintf("this instance speaks hand-over versions %d to %d, the new one %d to %d", lo, hi, m.MinVersion, m.Version)
		s.refuse(hc, why)
		return nil
	}
	if v >= takeVersion {
		if err := hc.Send(&Msg{Type: MsgWelcome, Version: v}); err != nil {
			s.warn("hand-over request abandoned before it paused anything", "err", err)
			return nil
		}
		take, err := hc.recvShort(MsgTake, s.t.Hello)
		if err == nil && take.Version != v {
			err = fmt.Errorf("a take in version %d after a welcome in version %d", take.Version, v)
		}
		if err != nil {
			s.warn("hand-over request abandoned before it paused anything", "err", err)
			return nil
		}
	}
	if !s.busy.TryLock() {
		s.refuse(hc, "another hand-over is in progress")
		return nil
	}
	defer s.busy.Unlock()
	if s.done {
		s.refuse(hc, "this instance handed the directory over already")
		return nil
	}
	ho := s.handOver(hc, v)
	if ho == nil {
		return nil
	}
	s.done = true
	return ho
}

// refuse tells the new instance why there is no hand-over.
func (s *Server) refuse(hc Conn, why string) {
	hc.Send(&Msg{Type: MsgRefuse, Reason: why})
	s.warn("hand-over refused; the new instance waits for this one to exit", "why", why)
}

// handOver stops the loops, sends what they hand over and the lock's descriptor, and lets go
// of the directory once the new instance acknowledged; otherwise the loops run again. It
// returns what was handed over, or nil.
func (s *Server) handOver(hc Conn, v int) *HandedOver {
	start := time.Now()
	snap := s.h.HandOver()
	hc.until = time.Now().Add(s.t.Pause)
	s.log.Info("handing over the registration directory to a new instance", "drivers", snap.Len(), "sockets", snap.Sockets(), "version", v)
	halt(s.log, "holder", "stopped")
	lockF, err := s.lock.File()
	if err == nil {
		err = sendSnapshot(hc, snap, v, lockF, s.log)
		lockF.Close()
	}
	var taken []ListenerSpec
	if err == nil {
		var reply *Msg
		var files []*os.File
		reply, files, err = hc.Recv()
		CloseAll(files)
		switch {
		case err != nil:
			err = fmt.Errorf("no acknowledgement: %w", err)
		case reply.Type == MsgAbort:
			err = fmt.Errorf("the new instance gave up: %s", reply.Reason)
		case reply.Type != MsgAck:
			err = fmt.Errorf("a %q message where an ack or an abort belongs", reply.Type)
		default:
			taken = snap.sentListeners(reply.Listeners)
		}
	}
	if err != nil {
		err = hc.gaveUp(err)
		// The lock stays held: this process never let go of its open file. A new instance
		// that has a copy of it lets go of that copy when no release comes, and waits.
		s.h.Resume(snap)
		s.log.Warn("hand-over failed; this instance goes on serving every driver", "err", err,
			"paused", time.Since(start).Round(time.Millisecond).String())
		return nil
	}
	hc.until = time.Time{}
	if unsent := snap.Unsent(v); unsent.Sockets() > 0 {
		// Withdrawn before the release, after which the new instance publishes these
		// drivers' sockets at their first path: kubelet lets go of the old ones first.
		s.log.Info("withdrawing the sockets the new instance cannot serve (hand-over version 1: a DRA driver's second registration path, a device plugin's third); it registers those drivers at their first path",
			"drivers", unsent.Len(), "sockets", unsent.Sockets())
		unsent.withdraw(s.log, "withdrew the sockets the new instance cannot serve; kubelet deregisters those removed")
	}
	s.lock.Let()
	halt(s.log, "holder", "released")
	if err := hc.Send(&Msg{Type: MsgReleased, Version: v}); err != nil {
		s.log.Warn("could not tell the new instance the directory is released; it finds out by itself", "err", err)
	}
	s.h.Release(taken)
	took := time.Since(start)
	s.log.Info("handed over the registration directory; this instance serves nothing now and exits on SIGTERM",
		"drivers", snap.Len(), "sockets", snap.Sockets(), "took", took.Round(time.Millisecond).String())
	return &HandedOver{Snapshot: snap, Took: took}
}

// abortGrace bounds the read of an abort already sent (Conn.gaveUp).
const abortGrace = 100 * time.Millisecond

// gaveUp is err, which ended the holder's side of a hand-over, or why the new instance gave up
// if it said so before it closed the connection: a new instance that refuses a batch says abort
// and closes with the batches after it unread, and the holder's next send, or its read of the
// answer, then fails on the closed connection before the abort is read (a read returns the
// connection's reset first, and what is queued after).
func (hc Conn) gaveUp(err error) error {
	if !errors.Is(err, syscall.EPIPE) && !errors.Is(err, syscall.ECONNRESET) {
		return err
	}
	hc.until = time.Now().Add(abortGrace) // the abort is queued already, if it came
	for range 2 {
		m, files, rerr := hc.Recv()
		CloseAll(files)
		switch {
		case rerr == nil && m.Type == MsgAbort:
			return fmt.Errorf("the new instance gave up: %s", m.Reason)
		case rerr == nil || !errors.Is(rerr, syscall.ECONNRESET):
			return err
		}
	}
	return err
}

// sendSnapshot sends snap in batches, the lock's descriptor with the last one.
func sendSnapshot(hc Conn, snap *Snapshot, v int, lockF *os.File, log *slog.Logger) error {
	var drivers []*Driver
	for _, hd := range snap.drivers {
		drivers = append(drivers, hd)
	}
	bs := batches(drivers, v)
	for i, batch := range bs {
		last := i == len(bs)-1
		m := &Msg{Type: MsgBatch, Version: v, Drivers: batch, Last: last, Lock: last}
		var files []*os.File
		for _, hd := range batch {
			for _, hs := range hd.SentIn(v) {
				files = append(files, hs.File)
			}
		}
		m.Sockets = len(files)
		if last {
			if v >= listenersVersion {
				for _, l := range snap.listeners {
					m.Listeners = append(m.Listeners, l.ListenerSpec)
					files = append(files, l.File)
				}
			}
			files = append(files, lockF)
		}
		if err := hc.Send(m, files...); err != nil {
			return err
		}
		if !last {
			halt(log, "holder", "batch", "drivers", len(batch))
		}
	}
	return nil
}

// batches cuts drivers into the batches of a hand-over in version v: at most batchDrivers
// drivers and about maxBatchBytes of JSON each (a message on a SOCK_SEQPACKET socket must fit
// the socket's send buffer whole), and at least one batch, which may be empty. A driver counts
// as a batch of it alone in version v: its encoding in that version, and the envelope's few
// bytes.
func batches(drivers []*Driver, v int) [][]*Driver {
	var out [][]*Driver
	var cur []*Driver
	size := 0
	for _, hd := range drivers {
		b, _ := json.Marshal(&Msg{Type: MsgBatch, Version: v, Drivers: []*Driver{hd}})
		if len(cur) > 0 && (len(cur) == batchDrivers || size+len(b) > maxBatchBytes) {
			out = append(out, cur)
			cur, size = nil, 0
		}
		cur = append(cur, hd)
		size += len(b)
	}
	return append(out, cur)
}
