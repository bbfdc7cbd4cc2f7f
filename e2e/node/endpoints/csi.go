package endpoints

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// CSIVendorVersion is the vendor_version the CSI endpoint reports in GetPluginInfo.
const CSIVendorVersion = "v0.0.0-e2e"

// CSIOptions describes the CSI node plugin StartCSI serves.
type CSIOptions struct {
	// Name is the driver name GetPluginInfo returns. Required.
	Name string
	// NodeID is the node_id NodeGetInfo returns; the kubelet writes it into CSINode. Required.
	NodeID string
	// MaxVolumes is NodeGetInfo's max_volumes_per_node; 0 means no limit.
	MaxVolumes int64
	// Topology, if not empty, is NodeGetInfo's accessible_topology segments. The kubelet copies
	// them into node labels, so the keys must be valid label keys.
	Topology map[string]string
	// FailNodeGetInfo makes the first N NodeGetInfo calls fail with codes.Unavailable.
	FailNodeGetInfo int
}

// CSI is a CSI node plugin endpoint: the Identity and Node services. The kubelet's CSI
// registration handler calls NodeGetInfo on it, over a new connection, when it registers the
// driver, and fails the registration if that call fails.
type CSI struct {
	srv  *server
	opts CSIOptions

	mu              sync.Mutex
	failNext        int
	ok, failed      int
	lastNodeGetInfo time.Time
	failedAt        []time.Time
}

// StartCSI serves a CSI node plugin on the unix socket path until Stop.
func StartCSI(path string, opts CSIOptions) (*CSI, error) {
	var errs []error
	if opts.Name == "" {
		errs = append(errs, errors.New("name: must not be empty"))
	}
	if opts.NodeID == "" {
		errs = append(errs, errors.New("nodeID: must not be empty"))
	}
	if opts.MaxVolumes < 0 {
		errs = append(errs, fmt.Errorf("maxVolumes: %d: must not be negative", opts.MaxVolumes))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("csi endpoint %q: %w", opts.Name, err)
	}
	opts.Topology = maps.Clone(opts.Topology)
	c := &CSI{opts: opts, failNext: opts.FailNodeGetInfo}
	srv, err := serve(path, func(s *grpc.Server) {
		csi.RegisterIdentityServer(s, &csiIdentity{name: opts.Name})
		csi.RegisterNodeServer(s, &csiNode{c: c})
	})
	if err != nil {
		return nil, fmt.Errorf("csi endpoint %q: %w", opts.Name, err)
	}
	c.srv = srv
	return c, nil
}

// Path returns the socket path the endpoint serves on.
func (c *CSI) Path() string { return c.srv.path }

// Stop stops serving and removes the socket if it is still the endpoint's own. It blocks until
// the server's goroutines have exited and is idempotent.
func (c *CSI) Stop() { c.srv.stop() }

// NodeGetInfoCalls reports how many NodeGetInfo calls succeeded and how many failed by
// injection (see CSIOptions.FailNodeGetInfo and SetFailNodeGetInfo).
func (c *CSI) NodeGetInfoCalls() (ok, failed int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.ok, c.failed
}

// LastNodeGetInfo returns when the last NodeGetInfo call, successful or failed, arrived; the zero
// time if none has.
func (c *CSI) LastNodeGetInfo() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.lastNodeGetInfo
}

// NodeGetInfoFailures returns when each NodeGetInfo call that failed by injection arrived, in
// order.
func (c *CSI) NodeGetInfoFailures() []time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]time.Time(nil), c.failedAt...)
}

// SetFailNodeGetInfo makes the next n NodeGetInfo calls fail with codes.Unavailable, replacing
// any failures still pending; n <= 0 lets every call succeed.
func (c *CSI) SetFailNodeGetInfo(n int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.failNext = max(n, 0)
}

// nodeGetInfo counts one NodeGetInfo call and decides whether it fails.
func (c *CSI) nodeGetInfo() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.lastNodeGetInfo = time.Now()
	if c.failNext > 0 {
		c.failNext--
		c.failed++
		c.failedAt = append(c.failedAt, c.lastNodeGetInfo)
		// The same words each time, as a real driver's failure says them: a countdown would
		// make each retry a new reason for whoever reports kubelet's words (the node
		// condition writes each new one).
		return status.Errorf(codes.Unavailable, "NodeGetInfo failure injected by the e2e CSI endpoint %q", c.opts.Name)
	}
	c.ok++
	return nil
}

// csiIdentity serves the Identity service: a ready plugin with no plugin capabilities, so no
// CONTROLLER_SERVICE.
type csiIdentity struct {
	csi.UnimplementedIdentityServer
	name string
}

func (i *csiIdentity) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: i.name, VendorVersion: CSIVendorVersion}, nil
}

func (*csiIdentity) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	return &csi.GetPluginCapabilitiesResponse{}, nil
}

func (*csiIdentity) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(true)}, nil
}

// csiNode serves the Node service: NodeGetInfo and an empty NodeGetCapabilities; the volume
// RPCs stay Unimplemented.
type csiNode struct {
	csi.UnimplementedNodeServer
	c *CSI
}

func (n *csiNode) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	if err := n.c.nodeGetInfo(); err != nil {
		return nil, err
	}
	resp := &csi.NodeGetInfoResponse{NodeId: n.c.opts.NodeID, MaxVolumesPerNode: n.c.opts.MaxVolumes}
	if len(n.c.opts.Topology) > 0 {
		resp.AccessibleTopology = &csi.Topology{Segments: maps.Clone(n.c.opts.Topology)}
	}
	return resp, nil
}

func (*csiNode) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	return &csi.NodeGetCapabilitiesResponse{}, nil
}
