package probe

import (
	"testing"

	csi "github.com/container-storage-interface/spec/lib/go/csi"
)

// TestSameNodeInfo: what kubelet records of NodeGetInfo decides; anything else does not.
func TestSameNodeInfo(t *testing.T) {
	base := func() *csi.NodeGetInfoResponse {
		return &csi.NodeGetInfoResponse{
			NodeId:             "n",
			MaxVolumesPerNode:  4,
			AccessibleTopology: &csi.Topology{Segments: map[string]string{"zone": "a"}},
		}
	}
	for name, tc := range map[string]struct {
		change func(*csi.NodeGetInfoResponse)
		same   bool
	}{
		"identical":   {func(*csi.NodeGetInfoResponse) {}, true},
		"node ID":     {func(r *csi.NodeGetInfoResponse) { r.NodeId = "m" }, false},
		"max volumes": {func(r *csi.NodeGetInfoResponse) { r.MaxVolumesPerNode = 5 }, false},
		"topology":    {func(r *csi.NodeGetInfoResponse) { r.AccessibleTopology.Segments["zone"] = "b" }, false},
		"no topology": {func(r *csi.NodeGetInfoResponse) { r.AccessibleTopology = nil }, false},
	} {
		r := base()
		tc.change(r)
		if got := SameNodeInfo(base(), r); got != tc.same {
			t.Errorf("%s: sameNodeInfo = %v, want %v", name, got, tc.same)
		}
	}
}
