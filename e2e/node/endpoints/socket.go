package endpoints

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	"google.golang.org/grpc"
)

// gracePeriod bounds GracefulStop in stop; after it, open RPCs and streams are cut.
const gracePeriod = time.Second

// server is one gRPC server on one unix socket: the listen, serve and stop part that the CSI,
// device-plugin and DRA endpoints share.
type server struct {
	path   string
	grpc   *grpc.Server
	socket fs.FileInfo   // the socket this server created, to recognise it at stop
	served chan struct{} // closed when Serve has returned

	stopOnce sync.Once
}

// serve listens on path, lets register add the services to a new gRPC server built with opts,
// and serves it in a goroutine that stop waits for.
func serve(path string, register func(*grpc.Server), opts ...grpc.ServerOption) (*server, error) {
	lis, err := listen(path)
	if err != nil {
		return nil, err
	}
	socket, err := os.Lstat(path)
	if err != nil {
		lis.Close()
		return nil, fmt.Errorf("stat %s: %w", path, err)
	}
	s := &server{
		path:   path,
		grpc:   grpc.NewServer(append(opts, grpc.WaitForHandlers(true))...),
		socket: socket,
		served: make(chan struct{}),
	}
	register(s.grpc)
	go func() {
		defer close(s.served)
		// Serve returns nil after Stop or GracefulStop, and otherwise only when Accept fails on
		// a listener nobody else closes; the caller then sees RPCs fail, which says enough.
		_ = s.grpc.Serve(lis)
	}()
	return s, nil
}

// listen creates path's parent directory if needed, removes a stale socket at path, and listens
// there. Anything at path that is not a socket is left alone and reported. The listener does not
// unlink path on Close: stop removes the socket only if it is still this one.
func listen(path string) (*net.UnixListener, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, fmt.Errorf("create socket directory: %w", err)
	}
	switch fi, err := os.Lstat(path); {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		return nil, fmt.Errorf("stat %s: %w", path, err)
	case fi.Mode().Type() != fs.ModeSocket:
		return nil, fmt.Errorf("%s: exists and is not a socket (mode %v), refusing to remove it", path, fi.Mode())
	default:
		if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("remove stale socket: %w", err)
		}
	}
	lis, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("listen %s: %w", path, err)
	}
	lis.SetUnlinkOnClose(false)
	if err := os.Chmod(path, 0o660); err != nil {
		lis.Close()
		os.Remove(path)
		return nil, fmt.Errorf("chmod %s: %w", path, err)
	}
	return lis, nil
}

// stop stops the server, gracefully for up to gracePeriod and then forcibly, waits for Serve and
// every handler to return, and removes the socket if it is still the one serve created. It is
// idempotent.
func (s *server) stop() {
	s.stopOnce.Do(func() {
		graceful := make(chan struct{})
		go func() {
			defer close(graceful)
			s.grpc.GracefulStop()
		}()
		timer := time.NewTimer(gracePeriod)
		select {
		case <-graceful:
		case <-timer.C:
			s.grpc.Stop()
			<-graceful
		}
		timer.Stop()
		<-s.served
		if fi, err := os.Lstat(s.path); err == nil && os.SameFile(fi, s.socket) {
			os.Remove(s.path)
		}
	})
}
