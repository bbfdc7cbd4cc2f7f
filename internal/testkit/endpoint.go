package testkit

import (
	"context"
	"errors"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
)

// Endpoint is a driver's endpoint: a unix socket that accepts connections, and for a CSI
// driver answers the Identity service with a name.
type Endpoint struct {
	path string
	srv  *grpc.Server
	done chan struct{}
}

// Path is where the endpoint listens.
func (e *Endpoint) Path() string { return e.path }

// Identity is a CSI driver's Identity service, answering under Name.
type Identity struct {
	csi.UnimplementedIdentityServer
	Name string
}

func (i Identity) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: i.Name, VendorVersion: "test"}, nil
}

// StartEndpoint serves a driver endpoint at path (creating its directory) until stopped or
// the test ends. A non-empty csiName serves the CSI Identity service under that name.
func StartEndpoint(t testing.TB, path, csiName string) *Endpoint {
	t.Helper()
	return ServeEndpoint(t, path, func(srv *grpc.Server) {
		if csiName != "" {
			csi.RegisterIdentityServer(srv, Identity{Name: csiName})
		}
	})
}

// ServeEndpoint serves, at path, the services that register registers.
func ServeEndpoint(t testing.TB, path string, register func(*grpc.Server)) *Endpoint {
	t.Helper()
	return ServeEndpointWith(t, path, register)
}

// ServeEndpointWith is ServeEndpoint on a gRPC server built with opts.
func ServeEndpointWith(t testing.TB, path string, register func(*grpc.Server), opts ...grpc.ServerOption) *Endpoint {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	e := &Endpoint{path: path, srv: grpc.NewServer(opts...), done: make(chan struct{})}
	register(e.srv)
	go func() {
		defer close(e.done)
		e.srv.Serve(l)
	}()
	t.Cleanup(e.Stop)
	return e
}

// Stop stops the endpoint and removes its socket, as a crashing driver's restart would.
func (e *Endpoint) Stop() {
	e.srv.Stop()
	<-e.done
	if err := os.Remove(e.path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		panic(err)
	}
}
