// Package sockfile is the life of a unix socket file that multireg serves: published by a
// rename so that it appears whole and already listening, never replacing what is not a
// socket, never removed unless it is still the one multireg put there; and whether another
// process serves a socket in the way.
package sockfile

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
	"multireg.dev/multireg/internal/fsid"
)

// ServedError reports a socket at a registration socket's path that is not ours and that
// another process serves: another registrar, such as a node-driver-registrar sidecar whose
// driver is being moved to multireg. It is never replaced: kubelet holds that registrar's
// registration, and replacing its socket would deregister the plugin now and again when that
// registrar exits and deletes the path. The socket is published once that one is gone or no
// longer served.
type ServedError struct{ Path string }

func (e *ServedError) Error() string {
	return fmt.Sprintf("registration socket %s is served by another process (another registrar, such as a node-driver-registrar sidecar): "+
		"multireg does not replace a socket it does not own, and publishes its own once that one is gone", e.Path)
}

// servedProbeTimeout bounds the look at whether another process serves a socket.
const servedProbeTimeout = time.Second

// CheckNotServed returns a *ServedError when a socket at path other than ours (the identity
// of our own socket there, or zero) is served: a process answers its Registration service's
// GetInfo, as kubelet would call it. A socket no one listens on is stale, and so is one whose
// process accepts connections but does not answer (a frozen process: the kernel accepts for
// it), such as an earlier multireg stopped after it lost the registration directory.
func CheckNotServed(path string, ours fsid.ID) error {
	id, mode, err := fsid.Stat(path)
	if err != nil || mode != fs.ModeSocket || id == ours {
		return nil
	}
	if AnswersGetInfo(path) {
		return &ServedError{Path: path}
	}
	return nil
}

// AnswersGetInfo reports whether a process answers GetInfo on the registration socket at path
// within servedProbeTimeout. An error from the service is an answer too.
func AnswersGetInfo(path string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), servedProbeTimeout)
	defer cancel()
	conn, err := Client(path)
	if err != nil {
		return false
	}
	defer conn.Close()
	_, err = registerapi.NewRegistrationClient(conn).GetInfo(ctx, &registerapi.InfoRequest{}, grpc.WaitForReady(false))
	switch status.Code(err) {
	case codes.OK:
		return true
	case codes.DeadlineExceeded, codes.Unavailable, codes.Canceled:
		return false
	}
	return true
}

// NotSocketError reports a file that is in the way of a registration socket. Such a file is
// never removed or replaced: it is not ours.
type NotSocketError struct {
	Path string
	Mode fs.FileMode
}

func (e *NotSocketError) Error() string {
	kind := "file"
	switch {
	case e.Mode&fs.ModeDir != 0:
		kind = "directory"
	case e.Mode&fs.ModeSymlink != 0:
		kind = "symlink"
	case e.Mode&fs.ModeNamedPipe != 0:
		kind = "named pipe"
	case e.Mode&(fs.ModeDevice|fs.ModeCharDevice) != 0:
		kind = "device"
	}
	return fmt.Sprintf("%s is a %s, not a socket: it is left untouched; remove it to let the registration socket be created", e.Path, kind)
}

// CheckSocketOrMissing fails when something other than a socket is at path.
func CheckSocketOrMissing(path string) (exists bool, err error) {
	_, mode, err := fsid.Stat(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return false, nil
	case err != nil:
		return false, err
	case mode&fs.ModeSocket == 0:
		return true, &NotSocketError{Path: path, Mode: mode}
	}
	return true, nil
}

// EnsureDir creates the registration directory, mode 0750 as kubelet creates it, if it is
// missing. Only the directory itself: a missing parent (kubelet's root directory) is an error,
// not something to make up with the process's owner-only umask.
func EnsureDir(dir string) error {
	if _, err := os.Stat(dir); err == nil {
		return nil
	}
	if err := os.Mkdir(dir, 0o750); errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("create registration directory %s: its parent %s does not exist (is registrationDir right, and is kubelet's root directory mounted?)", dir, filepath.Dir(dir))
	} else if errors.Is(err, fs.ErrExist) {
		return nil // created meanwhile, by kubelet or another loop
	} else if err != nil {
		return fmt.Errorf("create registration directory: %w", err)
	}
	// The process umask narrowed the mode; kubelet's own is 0750.
	if err := os.Chmod(dir, 0o750); err != nil {
		return fmt.Errorf("create registration directory: %w", err)
	}
	return nil
}

// Publish creates the registration socket at path, listening, with mode 0600 from the moment
// it has its final name: it listens on a hidden temporary name in the same directory (which
// kubelet ignores), restricts it, and renames it onto path, replacing a stale socket in one
// step, so kubelet sees exactly one Create for a socket that already accepts connections.
// Anything at path that is not a socket is never touched.
//
// serve, if not nil, starts serving the listener while it still has its temporary name, so
// that a failure to serve leaves whatever was at path untouched (the loop's registered socket,
// when it publishes anew over it); its undo runs when the publication fails after it.
//
// The listener does not unlink its path when closed: another generation's socket may have
// been renamed over it by then. Sockets are removed explicitly with RemoveIfOurs.
func Publish(path string, serve func(*net.UnixListener) (undo func(), err error)) (*net.UnixListener, fsid.ID, error) {
	return PublishAs("unix", path, serve)
}

// PublishAs is Publish for a unix socket of network ("unix", or "unixpacket" for the
// hand-over socket).
//
// A socket removed from path between its rename and the look that follows is published again
// at once, as a served socket that is removed is; a second removal is the caller's error.
func PublishAs(network, path string, serve func(*net.UnixListener) (undo func(), err error)) (*net.UnixListener, fsid.ID, error) {
	l, id, err := publishOnce(network, path, serve)
	if errors.Is(err, errRemovedAsPublished) {
		l, id, err = publishOnce(network, path, serve)
	}
	return l, id, err
}

// errRemovedAsPublished: nothing was at the socket's path right after the rename that put it
// there.
var errRemovedAsPublished = errors.New("removed as it was published")

// afterRename runs right after the rename that publishes a socket: its tests remove the socket
// there.
var afterRename = func(path string) {}

func publishOnce(network, path string, serve func(*net.UnixListener) (undo func(), err error)) (*net.UnixListener, fsid.ID, error) {
	dir := filepath.Dir(path)
	if err := EnsureDir(dir); err != nil {
		return nil, fsid.ID{}, err
	}
	exists, err := CheckSocketOrMissing(path)
	if err != nil {
		return nil, fsid.ID{}, err
	}
	tmp := filepath.Join(dir, TempName())
	l, err := net.ListenUnix(network, &net.UnixAddr{Name: tmp, Net: network})
	if err != nil {
		return nil, fsid.ID{}, fmt.Errorf("listen: %w", err)
	}
	l.SetUnlinkOnClose(false)
	undo := func() {}
	fail := func(err error) (*net.UnixListener, fsid.ID, error) {
		undo()
		l.Close()
		os.Remove(tmp)
		return nil, fsid.ID{}, err
	}
	if err := os.Chmod(tmp, 0o600); err != nil {
		return fail(fmt.Errorf("restrict socket: %w", err))
	}
	// Our socket's inode, taken under the name only we use: after the rename, the file at
	// path is ours only if it is this inode (another process may have renamed its own
	// socket there meanwhile). The listener holds the inode, so its number is not reused.
	mine, _, err := fsid.Stat(tmp)
	if err != nil {
		return fail(fmt.Errorf("Publish %s: %w", path, err))
	}
	if serve != nil {
		u, err := serve(l)
		if err != nil {
			return fail(err)
		}
		undo = u
	}
	if err := renameOnto(tmp, path, exists); err != nil {
		return fail(err)
	}
	afterRename(path)
	id, _, err := fsid.Stat(path) // the rename changed the change time: take the identity anew
	if errors.Is(err, fs.ErrNotExist) {
		return fail(fmt.Errorf("Publish %s: %w", path, errRemovedAsPublished))
	}
	if err != nil {
		return fail(fmt.Errorf("Publish %s: %w", path, err))
	}
	if id.Key() != mine.Key() {
		undo()
		l.Close()
		return nil, fsid.ID{}, fmt.Errorf("Publish %s: another socket replaced ours as it was published; it is left in place", path)
	}
	return l, id, nil
}

// renameOnto renames the socket tmp onto path without ever replacing anything there that is
// not a socket, even if it appeared after the last look: when nothing was at path the rename
// refuses to replace; when a socket was there the two are exchanged, and what comes out under
// the temporary name is removed only if it is a socket (otherwise it is put back).
func renameOnto(tmp, path string, exists bool) error {
	if !exists {
		err := unix.Renameat2(unix.AT_FDCWD, tmp, unix.AT_FDCWD, path, unix.RENAME_NOREPLACE)
		switch {
		case err == nil:
			return nil
		case errors.Is(err, unix.EEXIST):
			// Something appeared at path: leave it alone unless it is a socket (a stale
			// one is exchanged below). The exchange still guards the instant between.
			if _, err := CheckSocketOrMissing(path); err != nil {
				return err
			}
		case errors.Is(err, unix.EINVAL), errors.Is(err, unix.ENOSYS):
			return checkedRename(tmp, path)
		default:
			return fmt.Errorf("Publish %s: %w", path, err)
		}
	}
	err := unix.Renameat2(unix.AT_FDCWD, tmp, unix.AT_FDCWD, path, unix.RENAME_EXCHANGE)
	if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOSYS) {
		return checkedRename(tmp, path)
	}
	if err != nil {
		return fmt.Errorf("Publish %s: %w", path, err)
	}
	// tmp now holds what was at path.
	if _, mode, err := fsid.Stat(tmp); err == nil && mode&fs.ModeSocket == 0 {
		if err := unix.Renameat2(unix.AT_FDCWD, tmp, unix.AT_FDCWD, path, unix.RENAME_EXCHANGE); err != nil {
			return fmt.Errorf("Publish %s: put back what appeared there: %w", path, err)
		}
		return &NotSocketError{Path: path, Mode: mode}
	}
	if err := os.Remove(tmp); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("Publish %s: remove the replaced socket: %w", path, err)
	}
	return nil
}

// checkedRename is renameOnto for file systems without renameat2 flags: it looks, then
// renames.
func checkedRename(tmp, path string) error {
	if _, err := CheckSocketOrMissing(path); err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("Publish %s: %w", path, err)
	}
	return nil
}

// Temporary socket names: ".mr-<8 hex>.tmp", config.TempSocketNameLen bytes.
const (
	tempPrefix = ".mr-"
	tempSuffix = ".tmp"
)

func TempName() string {
	return fmt.Sprintf("%s%08x%s", tempPrefix, rand.Uint32(), tempSuffix)
}

// IsTempName reports whether name is one TempName makes.
func IsTempName(name string) bool {
	hex, ok := strings.CutPrefix(name, tempPrefix)
	if !ok {
		return false
	}
	hex, ok = strings.CutSuffix(hex, tempSuffix)
	if !ok || len(hex) != 8 {
		return false
	}
	for _, c := range hex {
		if !strings.ContainsRune("0123456789abcdef", c) {
			return false
		}
	}
	return true
}

// RemoveIfOurs removes the socket at path if it is still the one with identity id. It
// reports whether it removed it; a socket someone else put there is left alone.
func RemoveIfOurs(path string, id fsid.ID) (bool, error) {
	cur, _, err := fsid.Stat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	if cur != id {
		return false, nil
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return false, fmt.Errorf("remove socket: %w", err)
	}
	return true, nil
}

// RemoveStale removes a socket at path that nothing listens on: one left by an earlier run.
// A live socket (another registrar's) and anything that is not a socket stay.
func RemoveStale(path string) error {
	if exists, err := CheckSocketOrMissing(path); !exists || err != nil {
		var ns *NotSocketError
		if errors.As(err, &ns) {
			return nil
		}
		return err
	}
	c, err := net.DialTimeout("unix", path, time.Second)
	if err == nil {
		c.Close()
		return nil // someone serves it
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		return nil
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// Dial connects to the unix socket at path.
func Dial(ctx context.Context, path string) (net.Conn, error) {
	var dialer net.Dialer
	return dialer.DialContext(ctx, "unix", path)
}

// Client returns a gRPC client of the endpoint at path; it connects on its first call.
// The path never becomes part of a gRPC target: a target is parsed as a URL, and a path
// holding '#', '?' or '%' would be cut or decoded. The dialer dials the path itself.
func Client(path string) (*grpc.ClientConn, error) {
	return grpc.NewClient("passthrough:///localhost",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return Dial(ctx, path) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
}

// PeerCred returns the credentials of the process at the other end of c (SO_PEERCRED). Its
// pid is 0 when that process is outside this one's PID namespace (kubelet, for multireg in a
// pod).
func PeerCred(c *net.UnixConn) (*unix.Ucred, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	var cred *unix.Ucred
	var cerr error
	if err := rc.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return nil, err
	}
	if cerr != nil {
		return nil, fmt.Errorf("peer credentials: %w", cerr)
	}
	return cred, nil
}
