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
// looks for that connection on f. A socket's bound name cannot tell (getsockname gives the
// temporary name a published socket was bound at, before its rename onto path), and the file's
// identity only says what is at path, not what f is.
//
// The connection is told from any other queued on f by its own address, a random name in the
// abstract namespace. Other connections accepted on the way are closed: they can only be
// kubelet's (the holder accepts nothing during a hand-over, nor after it), and kubelet
// retries a registration whose GetInfo failed.
func boundAt(f *os.File, path string) error {
	name, err := checkAddr()
	if err != nil {
		return err
	}
	c, err := net.DialUnix("unix", &net.UnixAddr{Name: name, Net: "unix"}, &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return fmt.Errorf("nothing accepts connections at %s: %w", path, unwrapOp(err))
	}
	defer c.Close()
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	found := false
	var aerr error
	if err := rc.Control(func(fd uintptr) { found, aerr = acceptFrom(int(fd), name) }); err != nil {
		return err
	}
	if aerr != nil {
		return fmt.Errorf("accept on the descriptor handed for %s: %w", path, aerr)
	}
	if !found {
		return fmt.Errorf("the descriptor handed for %s is not the socket bound there: a connection to %s did not reach it", path, path)
	}
	return nil
}

// acceptFrom accepts, without waiting, the connections queued on the listening socket fd until
// one comes from the address name. It reports whether one did.
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
