package registrar

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
	"google.golang.org/grpc/status"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// fileID identifies one file: a file created anew at the same path gets another identity,
// even when the kernel reuses the inode number, because its change time differs.
type fileID struct {
	dev, ino uint64
	ctime    syscall.Timespec
}

// key is the file's device and inode, without the change time: what a rename keeps.
func (id fileID) key() fileKey { return fileKey{dev: id.dev, ino: id.ino} }

// statID returns the identity and type of the file at path, without following a symlink.
func statID(path string) (fileID, fs.FileMode, error) {
	fi, err := os.Lstat(path)
	if err != nil {
		return fileID{}, 0, err
	}
	id, err := idOf(path, fi)
	if err != nil {
		return fileID{}, 0, err
	}
	return id, fi.Mode().Type(), nil
}

// idOf is the identity of the file at path that fi describes.
func idOf(path string, fi fs.FileInfo) (fileID, error) {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return fileID{}, fmt.Errorf("stat %s: no unix stat", path)
	}
	return fileID{dev: st.Dev, ino: st.Ino, ctime: st.Ctim}, nil
}

// servedError reports a socket at a registration socket's path that is not ours and that
// another process serves: another registrar, such as a node-driver-registrar sidecar whose
// driver is being moved to multireg. It is never replaced: kubelet holds that registrar's
// registration, and replacing its socket would deregister the plugin now and again when that
// registrar exits and deletes the path. The socket is published once that one is gone or no
// longer served.
type servedError struct{ path string }

func (e *servedError) Error() string {
	return fmt.Sprintf("registration socket %s is served by another process (another registrar, such as a node-driver-registrar sidecar): "+
		"multireg does not replace a socket it does not own, and publishes its own once that one is gone", e.path)
}

// servedProbeTimeout bounds the look at whether another process serves a socket.
const servedProbeTimeout = time.Second

// checkNotServed returns a *servedError when a socket at path other than ours (the identity
// of our own socket there, or zero) is served: a process answers its Registration service's
// GetInfo, as kubelet would call it. A socket no one listens on is stale, and so is one whose
// process accepts connections but does not answer (a frozen process: the kernel accepts for
// it), such as an earlier multireg stopped after it lost the registration directory.
func checkNotServed(path string, ours fileID) error {
	id, mode, err := statID(path)
	if err != nil || mode != fs.ModeSocket || id == ours {
		return nil
	}
	if answersGetInfo(path) {
		return &servedError{path: path}
	}
	return nil
}

// answersGetInfo reports whether a process answers GetInfo on the registration socket at path
// within servedProbeTimeout. An error from the service is an answer too.
func answersGetInfo(path string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), servedProbeTimeout)
	defer cancel()
	conn, err := grpcClient(path)
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

// notSocketError reports a file that is in the way of a registration socket. Such a file is
// never removed or replaced: it is not ours.
type notSocketError struct {
	path string
	mode fs.FileMode
}

func (e *notSocketError) Error() string {
	kind := "file"
	switch {
	case e.mode&fs.ModeDir != 0:
		kind = "directory"
	case e.mode&fs.ModeSymlink != 0:
		kind = "symlink"
	case e.mode&fs.ModeNamedPipe != 0:
		kind = "named pipe"
	case e.mode&(fs.ModeDevice|fs.ModeCharDevice) != 0:
		kind = "device"
	}
	return fmt.Sprintf("%s is a %s, not a socket: it is left untouched; remove it to let the registration socket be created", e.path, kind)
}

// checkSocketOrMissing fails when something other than a socket is at path.
func checkSocketOrMissing(path string) (exists bool, err error) {
	_, mode, err := statID(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return false, nil
	case err != nil:
		return false, err
	case mode&fs.ModeSocket == 0:
		return true, &notSocketError{path: path, mode: mode}
	}
	return true, nil
}

// ensureDir creates the registration directory, mode 0750 as kubelet creates it, if it is
// missing. Only the directory itself: a missing parent (kubelet's root directory) is an error,
// not something to make up with the process's owner-only umask.
func ensureDir(dir string) error {
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

// publish creates the registration socket at path, listening, with mode 0600 from the moment
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
// been renamed over it by then. Sockets are removed explicitly with removeIfOurs.
func publish(path string, serve func(*net.UnixListener) (undo func(), err error)) (*net.UnixListener, fileID, error) {
	return publishAs("unix", path, serve)
}

// publishAs is publish for a unix socket of network ("unix", or "unixpacket" for the
// hand-over socket).
func publishAs(network, path string, serve func(*net.UnixListener) (undo func(), err error)) (*net.UnixListener, fileID, error) {
	dir := filepath.Dir(path)
	if err := ensureDir(dir); err != nil {
		return nil, fileID{}, err
	}
	exists, err := checkSocketOrMissing(path)
	if err != nil {
		return nil, fileID{}, err
	}
	tmp := filepath.Join(dir, tempSocketName())
	l, err := net.ListenUnix(network, &net.UnixAddr{Name: tmp, Net: network})
	if err != nil {
		return nil, fileID{}, fmt.Errorf("listen: %w", err)
	}
	l.SetUnlinkOnClose(false)
	undo := func() {}
	fail := func(err error) (*net.UnixListener, fileID, error) {
		undo()
		l.Close()
		os.Remove(tmp)
		return nil, fileID{}, err
	}
	if err := os.Chmod(tmp, 0o600); err != nil {
		return fail(fmt.Errorf("restrict socket: %w", err))
	}
	// Our socket's inode, taken under the name only we use: after the rename, the file at
	// path is ours only if it is this inode (another process may have renamed its own
	// socket there meanwhile). The listener holds the inode, so its number is not reused.
	mine, _, err := statID(tmp)
	if err != nil {
		return fail(fmt.Errorf("publish %s: %w", path, err))
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
	id, _, err := statID(path) // the rename changed the change time: take the identity anew
	if err != nil {
		return fail(fmt.Errorf("publish %s: %w", path, err))
	}
	if id.key() != mine.key() {
		undo()
		l.Close()
		return nil, fileID{}, fmt.Errorf("publish %s: another socket replaced ours as it was published; it is left in place", path)
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
			if _, err := checkSocketOrMissing(path); err != nil {
				return err
			}
		case errors.Is(err, unix.EINVAL), errors.Is(err, unix.ENOSYS):
			return checkedRename(tmp, path)
		default:
			return fmt.Errorf("publish %s: %w", path, err)
		}
	}
	err := unix.Renameat2(unix.AT_FDCWD, tmp, unix.AT_FDCWD, path, unix.RENAME_EXCHANGE)
	if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOSYS) {
		return checkedRename(tmp, path)
	}
	if err != nil {
		return fmt.Errorf("publish %s: %w", path, err)
	}
	// tmp now holds what was at path.
	if _, mode, err := statID(tmp); err == nil && mode&fs.ModeSocket == 0 {
		if err := unix.Renameat2(unix.AT_FDCWD, tmp, unix.AT_FDCWD, path, unix.RENAME_EXCHANGE); err != nil {
			return fmt.Errorf("publish %s: put back what appeared there: %w", path, err)
		}
		return &notSocketError{path: path, mode: mode}
	}
	if err := os.Remove(tmp); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("publish %s: remove the replaced socket: %w", path, err)
	}
	return nil
}

// checkedRename is renameOnto for file systems without renameat2 flags: it looks, then
// renames.
func checkedRename(tmp, path string) error {
	if _, err := checkSocketOrMissing(path); err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("publish %s: %w", path, err)
	}
	return nil
}

// Temporary socket names: ".mr-<8 hex>.tmp", config.TempSocketNameLen bytes.
const (
	tempPrefix = ".mr-"
	tempSuffix = ".tmp"
)

func tempSocketName() string {
	return fmt.Sprintf("%s%08x%s", tempPrefix, rand.Uint32(), tempSuffix)
}

// isTempSocketName reports whether name is one tempSocketName makes.
func isTempSocketName(name string) bool {
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

// removeIfOurs removes the socket at path if it is still the one with identity id. It
// reports whether it removed it; a socket someone else put there is left alone.
func removeIfOurs(path string, id fileID) (bool, error) {
	cur, _, err := statID(path)
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

// removeStale removes a socket at path that nothing listens on: one left by an earlier run.
// A live socket (another registrar's) and anything that is not a socket stay.
func removeStale(path string) error {
	if exists, err := checkSocketOrMissing(path); !exists || err != nil {
		var ns *notSocketError
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
