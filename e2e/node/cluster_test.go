package node_test

import (
	"bufio"
	"context"
	"regexp"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"multireg.dev/multireg/e2e/node/cluster"
)

// What the API server and kubelet say about the node.

// csiNodeDrivers returns CSINode's drivers of the node: name → node ID.
func csiNodeDrivers(ctx context.Context) (map[string]string, error) {
	n, err := cl.Client.StorageV1().CSINodes().Get(ctx, cluster.NodeName, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	out := map[string]string{}
	for _, d := range n.Spec.Drivers {
		out[d.Name] = d.NodeID
	}
	return out, nil
}

// capacity returns the node's capacity and allocatable of an extended resource.
func capacity(ctx context.Context, resource string) (capacity, allocatable int64, err error) {
	n, err := cl.Client.CoreV1().Nodes().Get(ctx, cluster.NodeName, metav1.GetOptions{})
	if err != nil {
		return 0, 0, err
	}
	c := n.Status.Capacity[corev1.ResourceName(resource)]
	a := n.Status.Allocatable[corev1.ResourceName(resource)]
	return c.Value(), a.Value(), nil
}

var pluginMetric = regexp.MustCompile(`^plugin_manager_total_plugins\{socket_path="([^"]+)",state="actual_state_of_world"\} (\d+)`)

// kubeletRegistered returns the registration sockets kubelet's plugin manager holds as
// registered (its actual state of the world: RegisterPlugin succeeded), read from kubelet's
// own metrics.
func kubeletRegistered(ctx context.Context) (map[string]bool, error) {
	text, err := cl.KubeletMetrics(ctx)
	if err != nil {
		return nil, err
	}
	out := map[string]bool{}
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if m := pluginMetric.FindStringSubmatch(sc.Text()); m != nil {
			n, _ := strconv.Atoi(m[2])
			out[m[1]] = n > 0
		}
	}
	return out, sc.Err()
}
