package config

import "fmt"

// DeviceMoves is how a device plugin's new instance is registered.
type DeviceMoves string

const (
	// MovesAuto: beside the old instance while kubelet's pod-resources API answers and no
	// move since kubelet started has dropped the resource's devices; as MovesAfter otherwise.
	MovesAuto DeviceMoves = "auto"
	// MovesBeside: always beside the old instance (kubelet 1.37 and later). A drop of the
	// resource's devices seen in kubelet's view is still repaired.
	MovesBeside DeviceMoves = "beside"
	// MovesAfter: always in place of the old instance's registration, withdrawn as the new
	// one's socket appears (kubelet deregisters it first, in the same reconcile pass).
	MovesAfter DeviceMoves = "after"
)

// ParseDeviceMoves reads a DeviceMoves ("" is MovesAuto).
func ParseDeviceMoves(s string) (DeviceMoves, error) {
	switch m := DeviceMoves(s); m {
	case "":
		return MovesAuto, nil
	case MovesAuto, MovesBeside, MovesAfter:
		return m, nil
	}
	return "", fmt.Errorf("%q: must be %s, %s or %s", s, MovesAuto, MovesBeside, MovesAfter)
}
