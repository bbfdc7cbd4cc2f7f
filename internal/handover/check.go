package handover

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"

	"golang.org/x/sys/unix"
)

// What the new instance checks of a handed socket, rather than trust what the predecessor says
// of it.

// boundAt checks that the listening socket f is the one bound at path: it connects to path and
// looks for that connection on f. The file's identity only says what is at path, not what f
// is; and f's bound name is the temporary name a published socket was bound at before its
// rename onto path.
//
// The connection is told from others by its own address, a random name in the abstract
// namespace, and accepted without waiting. When connections wait on f already (kubelet's,
// queued during the hand-over), none is taken from kubelet: the check then compares the name
// f is bound at with the name of the socket the connection to path reached, unique temporary
// names both (a weaker check: a predecessor would have to bind two sockets in turn at one
// name to pass it), and leaves its connection in the queue, closed.
func boundAt(f *os.File, path string) error {
	name, err := checkAddr()
	if err != nil {
		return err
	}
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	waiting := false
	if err := rc.Control(func(fd uintptr) { waiting = pending(int(fd)) }); err != nil {
		return err
	}
	c, err := net.DialUnix("unix", &net.UnixAddr{Name: name, Net: "unix"}, &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return fmt.Errorf("nothing accepts connections at %s: %w", path, unwrapOp(err))
	}
	defer c.Close()
	found := false
	var cerr error
	if err := rc.Control(func(fd uintptr) {
		if waiting {
			found, cerr = sameBoundName(fd, c)
			return
		}
		found, cerr = acceptFrom(int(fd), name)
	}); err != nil {
		return err
	}
	if cerr != nil {
		return fmt.Errorf("check the descriptor handed for %s: %w", path, cerr)
	}
	if !found {
		return fmt.Errorf("the descriptor handed for %s is not the socket bound there: a connection to %s did not reach it", path, path)
	}
	return nil
}

// pending reports whether connections wait to be accepted on the listening socket fd.
func pending(fd int) bool {
	p := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	n, err := unix.Poll(p, 0)
	return err == nil && n > 0 && p[0].Revents&unix.POLLIN != 0
}

// sameBoundName reports whether the listening socket fd is bound at the name of the socket
// the connection c reached.
func sameBoundName(fd uintptr, c *net.UnixConn) (bool, error) {
	sa, err := unix.Getsockname(int(fd))
	if err != nil {
		return false, err
	}
	crc, err := c.SyscallConn()
	if err != nil {
		return false, err
	}
	var peer unix.Sockaddr
	var perr error
	if err := crc.Control(func(cfd uintptr) { peer, perr = unix.Getpeername(int(cfd)) }); err != nil {
		return false, err
	}
	if perr != nil {
		return false, perr
	}
	a, ok1 := sa.(*unix.SockaddrUnix)
	b, ok2 := peer.(*unix.SockaddrUnix)
	return ok1 && ok2 && a.Name != "" && a.Name == b.Name, nil
}

// acceptFrom accepts, without waiting, the connections queued on the listening socket fd until
// one comes from the address name. It reports whether one did. Another accepted on the way
// (one that came between the look at the queue and the check's own) is closed: kubelet
// retries a registration whose GetInfo failed.
func acceptFrom(fd int, name string) (bool, error) {
	// The open file is shared with the holder's copy; Go makes its listeners non-blocking,
	// and so does the listener that will serve f (net.FileListener).
	if err := unix.SetNonblock(fd, true); err != nil {
		return false, err
	}
	for {
		nfd, sa, err := unix.Accept4(fd, unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC)
		switch {
		case errors.Is(err, unix.EINTR) || errors.Is(err, unix.ECONNABORTED):
			continue
		case errors.Is(err, unix.EAGAIN):
			return false, nil
		case err != nil:
			return false, err
		}
		unix.Close(nfd)
		if u, ok := sa.(*unix.SockaddrUnix); ok && u.Name == name {
			return true, nil
		}
	}
}

// checkAddr is a fresh abstract address for the connection of boundAt.
func checkAddr() (string, error) {
	var b [12]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	return "@multireg-handover-check-" + hex.EncodeToString(b[:]), nil
}

// unwrapOp is err without net's operation and addresses: the error of a dial names the path
// already, and the local address is the check's own.
func unwrapOp(err error) error {
	if oe, ok := errors.AsType[*net.OpError](err); ok && oe.Err != nil {
		return oe.Err
	}
	return err
}
