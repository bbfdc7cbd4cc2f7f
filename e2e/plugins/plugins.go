// Package plugins runs fake plugin services: the sockets that CSI drivers, DRA drivers and
// device plugins serve, which multireg probes and kubelet dials.
package plugins

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"sync/atomic"
	"time"

	csi "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Endpoint is one fake plugin service on a unix socket.
type Endpoint struct {
	Path string
	srv  *grpc.Server
	done chan struct{}
	node *node // a CSI plugin's Node service; nil for the other types
}

// DefaultNodeID is the node ID a CSI plugin started by Start answers NodeGetInfo with.
const DefaultNodeID = "e2e-node"

// Start serves a plugin of the type at path, creating its directory. A CSI plugin answers the
// Identity service with name and the Node service's NodeGetInfo with DefaultNodeID; the
// others accept gRPC connections, which is all multireg's probe and the test kubelet's check
// need.
func Start(path, typ, name string) (*Endpoint, error) {
	return StartNode(path, typ, name, DefaultNodeID)
}

// StartNode is Start with a CSI plugin whose NodeGetInfo answers nodeID.
func StartNode(path, typ, name, nodeID string) (*Endpoint, error) {
	var n *node
	e, err := startServer(path, name, func(s *grpc.Server) {
		if typ == "CSIPlugin" {
			n = &node{id: nodeID}
			csi.RegisterIdentityServer(s, &identity{name: name})
			csi.RegisterNodeServer(s, n)
		}
	})
	if err != nil {
		return nil, err
	}
	e.node = n
	return e, nil
}

// startServer serves at path, creating its directory, the services register registers, on a
// gRPC server built with opts.
func startServer(path, name string, register func(*grpc.Server), opts ...grpc.ServerOption) (*Endpoint, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, err
	}
	l, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("plugin %s: %w", name, err)
	}
	e := &Endpoint{Path: path, srv: grpc.NewServer(opts...), done: make(chan struct{})}
	register(e.srv)
	go func() {
		defer close(e.done)
		_ = e.srv.Serve(l)
	}()
	return e, nil
}

// Stop stops serving and removes the socket, as a crashing driver leaves it. It is safe to
// call twice.
func (e *Endpoint) Stop() {
	e.srv.Stop()
	<-e.done
	if err := os.Remove(e.Path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		panic(err)
	}
}

type identity struct {
	csi.UnimplementedIdentityServer
	name string
}

func (i identity) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: i.name, VendorVersion: "e2e"}, nil
}

func (identity) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return &csi.ProbeResponse{}, nil
}

// NodeGetInfoCalls returns how many times a CSI plugin was asked NodeGetInfo: in the e2e
// tests only multireg asks it (the test kubelet's handlers do not dial the plugins).
func (e *Endpoint) NodeGetInfoCalls() int {
	if e.node == nil {
		return 0
	}
	return int(e.node.calls.Load())
}

type node struct {
	csi.UnimplementedNodeServer
	id    string
	calls atomic.Int32
}

func (n *node) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	n.calls.Add(1)
	return &csi.NodeGetInfoResponse{NodeId: n.id}, nil
}

// StartDRAHealth serves a DRA plugin at path, as Start does, that also serves
// v1alpha1.DRAResourceHealth: NodeWatchResources sends one (empty) report and stays open, as a
// driver with healthy devices and nothing to add does. The service is described here rather
// than taken from k8s.io/kubelet, whose releases before 1.34 lack it: the suites build against
// every kubelet from 1.33 on.
func StartDRAHealth(path, name string) (*Endpoint, error) {
	return startServer(path, name, func(s *grpc.Server) { s.RegisterService(&draHealthDesc, nil) })
}

// StartDRAHealthSlow is StartDRAHealth with every NodeWatchResources answer delay late (a
// stream interceptor holds the call before its handler): v1alpha1's report, and
// v1.DRAResourceHealth's Unimplemented. For that, v1 is registered with a handler that answers
// Unimplemented, as a driver built on the generated Unimplemented server does: a gRPC server
// answers a service it does not know at once, before any interceptor runs.
func StartDRAHealthSlow(path, name string, delay time.Duration) (*Endpoint, error) {
	hold := func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		t := time.NewTimer(delay)
		defer t.Stop()
		select {
		case <-t.C:
		case <-ss.Context().Done():
			return ss.Context().Err()
		}
		return handler(srv, ss)
	}
	return startServer(path, name, func(s *grpc.Server) {
		s.RegisterService(&draHealthDesc, nil)
		s.RegisterService(&draHealthV1UnimplementedDesc, nil)
	}, grpc.StreamInterceptor(hold))
}

// draHealthDesc is v1alpha1.DRAResourceHealth with its one method. Its request and response
// are read and written as an empty message (any will do: CSI's ProbeRequest), which is a
// report without devices on the wire.
var draHealthDesc = grpc.ServiceDesc{
	ServiceName: "v1alpha1.DRAResourceHealth",
	HandlerType: (*any)(nil),
	Streams: []grpc.StreamDesc{{
		StreamName:    "NodeWatchResources",
		ServerStreams: true,
		Handler: func(_ any, stream grpc.ServerStream) error {
			if err := stream.RecvMsg(new(csi.ProbeRequest)); err != nil {
				return err
			}
			if err := stream.SendMsg(new(csi.ProbeRequest)); err != nil {
				return err
			}
			<-stream.Context().Done()
			return nil
		},
	}},
}

// draHealthV1UnimplementedDesc is v1.DRAResourceHealth answering Unimplemented, as the
// generated UnimplementedDRAResourceHealthServer does.
var draHealthV1UnimplementedDesc = grpc.ServiceDesc{
	ServiceName: "v1.DRAResourceHealth",
	HandlerType: (*any)(nil),
	Streams: []grpc.StreamDesc{{
		StreamName:    "NodeWatchResources",
		ServerStreams: true,
		Handler: func(any, grpc.ServerStream) error {
			return status.Error(codes.Unimplemented, "method NodeWatchResources not implemented")
		},
	}},
}
