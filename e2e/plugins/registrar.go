package plugins

import (
	"context"
	"net"
	"os"
	"path/filepath"

	"google.golang.org/grpc"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// Registrar is another registrar than multireg, as simple as they come: it serves the
// Registration API on one socket, answers GetInfo with a fixed PluginInfo, accepts every
// verdict and never recreates its socket (node-driver-registrar without its exit).
type Registrar struct {
	srv  *grpc.Server
	done chan struct{}
}

// ServeRegistrar serves info on a new socket at path (creating its directory). The socket
// file stays when the registrar stops.
func ServeRegistrar(path string, info *registerapi.PluginInfo) (*Registrar, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
		return nil, err
	}
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, err
	}
	l.SetUnlinkOnClose(false)
	r := &Registrar{srv: grpc.NewServer(), done: make(chan struct{})}
	registerapi.RegisterRegistrationServer(r.srv, staticRegistration{info: info})
	go func() {
		defer close(r.done)
		_ = r.srv.Serve(l)
	}()
	return r, nil
}

// Stop stops serving; the socket file stays.
func (r *Registrar) Stop() {
	r.srv.Stop()
	<-r.done
}

type staticRegistration struct {
	registerapi.UnimplementedRegistrationServer
	info *registerapi.PluginInfo
}

func (s staticRegistration) GetInfo(context.Context, *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	return s.info, nil
}

func (staticRegistration) NotifyRegistrationStatus(context.Context, *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	return &registerapi.RegistrationStatusResponse{}, nil
}
