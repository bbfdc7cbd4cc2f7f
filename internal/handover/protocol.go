package handover

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"
	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/sockfile"
)

// Name is the socket a holder listens on for a new instance, in the registration directory.
const Name = ".multireg.handover"

// The hand-over protocol versions this build speaks (the package comment: Versions).
const (
	minVersion = 1
	maxVersion = 2
)

// takeVersion is the first version in which the new instance says take before the holder
// stops its loops; listenersVersion the first whose last batch may carry listeners.
const (
	takeVersion      = 2
	listenersVersion = 2
)

// maxListeners bounds the listeners a batch may carry: the process serves three (--http-endpoint,
// --health-endpoint, --health-grpc-endpoint).
const maxListeners = 4

// Timeouts bound a hand-over's steps. A zero field takes its default.
type Timeouts struct {
	// Step bounds each read of a hand-over, on either side, and each write: a peer that does
	// not answer within it has failed. Default DefaultStepTimeout.
	Step time.Duration
	// Hello bounds the holder's wait for a request's hello, and for its take after the
	// welcome: a connection that says nothing costs no more, and pauses nothing. Default
	// DefaultHelloTimeout.
	Hello time.Duration
	// Pause bounds what a hand-over pauses: from the moment the holder's loops stop until the
	// new instance acknowledges, every batch sent and the ack received. A new instance
	// acknowledges as soon as it has the batches and has locked the lock's descriptor.
	// Default DefaultPauseTimeout.
	Pause time.Duration
}

// The default Timeouts.
const (
	DefaultStepTimeout  = 5 * time.Second
	DefaultHelloTimeout = time.Second
	DefaultPauseTimeout = time.Second
)

// orDefaults is t with its zero fields at their defaults.
func (t Timeouts) orDefaults() Timeouts {
	if t.Step <= 0 {
		t.Step = DefaultStepTimeout
	}
	if t.Hello <= 0 {
		t.Hello = DefaultHelloTimeout
	}
	if t.Pause <= 0 {
		t.Pause = DefaultPauseTimeout
	}
	return t
}

const (
	// batchDrivers is how many drivers one batch carries at most: two descriptors each, well
	// under the kernel's 253 per message.
	batchDrivers = 64
	// maxBatchBytes bounds a batch's JSON, far below the default send buffer of a unix socket
	// (net.core.wmem_default, 208 KiB), which a SOCK_SEQPACKET message must fit whole. A
	// driver's part is a few KiB at most (its last error is cut short: maxLastError).
	maxBatchBytes = 64 << 10
	// maxMessage bounds what a reader accepts.
	maxMessage = 1 << 20
)

// Msg is one message of a hand-over.
type Msg struct {
	Type string `json:"type"` // hello, refuse, welcome, take, batch, ack, abort, released
	// MinVersion and Version: the range the new instance speaks (hello); the version picked
	// (welcome, batch), which every later message keeps.
	MinVersion int    `json:"minVersion,omitempty"`
	Version    int    `json:"version,omitempty"`
	Reason     string `json:"reason,omitempty"` // refuse, abort
	// Drivers are the batch's drivers, on the wire as the message's version writes them
	// (wire.go); the descriptors of their sockets come with the message, in order, then the
	// lock's when Lock is set (the last batch).
	Drivers []*Driver `json:"drivers,omitempty"`
	Lock    bool      `json:"lock,omitempty"`
	Last    bool      `json:"last,omitempty"`
	// Sockets: how many socket descriptors the message carries besides the lock's.
	Sockets int `json:"sockets,omitempty"`
	// Listeners: the last batch's listening TCP sockets (version 2 on), whose descriptors
	// follow the sockets' and come before the lock's: the process's HTTP and health endpoints,
	// which the new instance serves on at once, so that no request is refused while the two
	// change places; in an ack, those the new instance took, which the holder serves no more.
	Listeners []ListenerSpec `json:"listeners,omitempty"`
}

// ListenerSpec names a listening socket handed over: the flag it serves (Name) and the
// address the flag gave it (Addr).
type ListenerSpec struct {
	Name string `json:"name"`
	Addr string `json:"addr"`
}

// Conn is one end of a hand-over connection.
type Conn struct {
	c *net.UnixConn
	// step bounds each read and write (Timeouts.Step); 0: DefaultStepTimeout.
	step time.Duration
	// until, if set, bounds every step from now on, besides step.
	until time.Time
}

// WithStep is h with each read and write bounded by step.
func (h Conn) WithStep(step time.Duration) Conn {
	h.step = step
	return h
}

// stepTimeout is the bound of each read and write.
func (h Conn) stepTimeout() time.Duration {
	if h.step <= 0 {
		return DefaultStepTimeout
	}
	return h.step
}

// deadline is the deadline of a step of timeout that starts now.
func (h Conn) deadline(timeout time.Duration) time.Time {
	d := time.Now().Add(timeout)
	if !h.until.IsZero() && h.until.Before(d) {
		return h.until
	}
	return d
}

// UnixConn is the connection itself.
func (h Conn) UnixConn() *net.UnixConn { return h.c }

// Close closes the connection.
func (h Conn) Close() error { return h.c.Close() }

// Send writes m with the descriptors files, in one message.
func (h Conn) Send(m *Msg, files ...*os.File) error {
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	if len(b) > maxMessage {
		return fmt.Errorf("hand-over message of %d bytes is too large", len(b))
	}
	fds := make([]int, 0, len(files))
	for _, f := range files {
		fd, err := rawFD(f)
		if err != nil {
			return err
		}
		fds = append(fds, fd)
	}
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	h.c.SetWriteDeadline(h.deadline(h.stepTimeout()))
	n, oobn, err := h.c.WriteMsgUnix(b, oob, nil)
	if err != nil {
		return fmt.Errorf("send %s: %w", m.Type, unwrapOp(err))
	}
	if n != len(b) || oobn != len(oob) {
		return fmt.Errorf("send %s: short write", m.Type)
	}
	return nil
}

// Recv reads one message and its descriptors, which the caller owns. It fails on a message
// or descriptors cut short, on the end of the connection (io.EOF) and when nothing comes
// within the step's bound.
func (h Conn) Recv() (*Msg, []*os.File, error) {
	m, files, _, err := h.recv(make([]byte, maxMessage), h.stepTimeout())
	return m, files, err
}

// recvShort reads a message of type typ that opens a request (hello, take), within timeout
// and helloBytes. Descriptors that come with it are closed.
func (h Conn) recvShort(typ string, timeout time.Duration) (*Msg, error) {
	m, files, _, err := h.recv(make([]byte, helloBytes), timeout)
	CloseAll(files)
	switch {
	case err != nil:
		return nil, fmt.Errorf("no %s within %s: %w", typ, timeout, err)
	case m.Type != typ:
		return nil, fmt.Errorf("a %q message where a %s belongs", m.Type, typ)
	}
	return m, nil
}

// recv is Recv of a message of at most len(b) bytes, read into b, within timeout. It also
// returns the message's size.
func (h Conn) recv(b []byte, timeout time.Duration) (*Msg, []*os.File, int, error) {
	oob := make([]byte, unix.CmsgSpace(4*(2*batchDrivers+1)))
	h.c.SetReadDeadline(h.deadline(timeout))
	n, oobn, flags, _, err := h.c.ReadMsgUnix(b, oob)
	files, ferr := receivedFiles(oob[:oobn])
	switch {
	case err != nil:
		CloseAll(files)
		return nil, nil, 0, fmt.Errorf("receive: %w", unwrapOp(err)) // not the socket's temporary bound name
	case ferr != nil:
		CloseAll(files)
		return nil, nil, 0, ferr
	case n == 0 && oobn == 0:
		return nil, nil, 0, errPeerGone
	case flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0:
		CloseAll(files)
		return nil, nil, 0, errors.New("hand-over message or its descriptors cut short")
	}
	var m Msg
	if err := json.Unmarshal(b[:n], &m); err != nil {
		CloseAll(files)
		return nil, nil, 0, fmt.Errorf("hand-over message: %w", err)
	}
	return &m, files, n, nil
}

// errPeerGone: the other end closed the connection, or its process ended.
var errPeerGone = errors.New("the other instance closed the hand-over connection")

// receivedFiles wraps the descriptors of SCM_RIGHTS control messages (close-on-exec: Go
// receives with MSG_CMSG_CLOEXEC).
func receivedFiles(oob []byte) ([]*os.File, error) {
	if len(oob) == 0 {
		return nil, nil
	}
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, fmt.Errorf("hand-over descriptors: %w", err)
	}
	var files []*os.File
	for i := range msgs {
		fds, err := unix.ParseUnixRights(&msgs[i])
		if err != nil {
			return files, fmt.Errorf("hand-over descriptors: %w", err)
		}
		for _, fd := range fds {
			files = append(files, os.NewFile(uintptr(fd), "handed"))
		}
	}
	return files, nil
}

// rawFD returns f's descriptor without os.File.Fd, which would make a socket blocking: the
// mode is the open file's, shared with every process that holds it.
func rawFD(f *os.File) (int, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return -1, err
	}
	fd := -1
	if err := rc.Control(func(u uintptr) { fd = int(u) }); err != nil {
		return -1, err
	}
	return fd, nil
}

// CloseAll closes files.
func CloseAll(files []*os.File) {
	for _, f := range files {
		f.Close()
	}
}

// sameUser checks that the process at the other end of c runs as this process's user: the
// sockets and the directory are this user's, and nobody else's process may take them or hand
// some over.
func sameUser(c *net.UnixConn) error {
	cred, err := sockfile.PeerCred(c)
	if err != nil {
		return err
	}
	if uid := uint32(os.Getuid()); cred.Uid != uid {
		return fmt.Errorf("the other process runs as uid %d, not %d", cred.Uid, uid)
	}
	return nil
}

// Listen listens for hand-over requests at dir's Name, replacing what an earlier holder left
// there: only the holder of the directory's lock calls it. The socket is
// published as a registration socket is (sockfile.Publish): 0600 from the moment it has its name, and
// not unlinked when closed, since by then a new holder may have put its own there.
func Listen(dir string) (*Listener, error) {
	path := filepath.Join(dir, Name)
	l, id, err := sockfile.PublishAs("unixpacket", path, nil)
	if err != nil {
		return nil, fmt.Errorf("listen for hand-overs: %w", err)
	}
	return &Listener{UnixListener: l, path: path, id: id}, nil
}

// Listener is a holder's hand-over socket.
type Listener struct {
	*net.UnixListener
	path string
	id   fsid.ID
}

// Close stops accepting hand-overs and removes the socket, if it is still this one: a new
// instance's socket, published over it, stays. A holder gone leaves nothing in kubelet's
// registration directory (kubelet ignores the name, but an uninstall should leave none).
func (l *Listener) Close() error {
	err := l.UnixListener.Close()
	if _, rerr := sockfile.RemoveIfOurs(l.path, l.id); rerr != nil && err == nil {
		err = rerr
	}
	return err
}

// Dial connects to the holder of dir. It fails at once when no holder listens (an
// older multireg, or one that stopped): the caller then waits for the lock.
func Dial(dir string) (Conn, error) {
	path := filepath.Join(dir, Name)
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		return Conn{}, err
	}
	if err := sameUser(c); err != nil {
		c.Close()
		return Conn{}, fmt.Errorf("%s: %w", path, err)
	}
	return Conn{c: c}, nil
}

// protocolRange is the range of hand-over versions this process speaks: minVersion to
// maxVersion, or the one a fault-injecting build is pinned to (pinnedVersion).
func protocolRange() (lo, hi int) {
	if v, ok := pinnedVersion(); ok {
		return v, v
	}
	return minVersion, maxVersion
}

// Enabled reports whether this process takes part in hand-overs at all.
func Enabled() bool {
	_, hi := protocolRange()
	return hi > 0
}

// pickVersion is the highest version both sides speak, or 0.
func pickVersion(peerLo, peerHi int) int {
	lo, hi := protocolRange()
	v := min(hi, peerHi)
	if v < max(lo, peerLo) {
		return 0
	}
	return v
}
