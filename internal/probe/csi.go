package probe

import (
	"context"
	"fmt"

	csi "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/proto"
	"multireg.dev/multireg/internal/sockfile"
)

// NodeInfo asks the CSI driver at the endpoint what kubelet's CSI handler asks it at
// registration.
func NodeInfo(ctx context.Context, endpoint string) (*csi.NodeGetInfoResponse, error) {
	ctx, cancel := context.WithTimeout(ctx, Timeout)
	defer cancel()
	conn, err := sockfile.Client(endpoint)
	if err != nil {
		return nil, fmt.Errorf("endpoint %s: %w", endpoint, err)
	}
	defer conn.Close()
	info, err := csi.NewNodeClient(conn).NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	if err != nil {
		return nil, fmt.Errorf("CSI NodeGetInfo on %s: %w", endpoint, err)
	}
	return info, nil
}

// SameNodeInfo reports whether two NodeGetInfo answers tell kubelet the same: node ID, max
// volumes per node and accessible topology.
func SameNodeInfo(a, b *csi.NodeGetInfoResponse) bool {
	return proto.Equal(RegisteredPart(a), RegisteredPart(b))
}

// RegisteredPart is what kubelet records of a NodeGetInfo answer.
func RegisteredPart(r *csi.NodeGetInfoResponse) *csi.NodeGetInfoResponse {
	return &csi.NodeGetInfoResponse{
		NodeId:             r.GetNodeId(),
		MaxVolumesPerNode:  r.GetMaxVolumesPerNode(),
		AccessibleTopology: r.GetAccessibleTopology(),
	}
}
