package node_test

import (
	"bufio"
	"context"
	"fmt"
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

// probeCount is what kubelet's prober counted of one container's probes of one kind
// ("Liveness", "Readiness") since kubelet started (prober_probe_total, on /metrics/probes): its
// counters are the running kubelet's, from 0 at its start.
type probeCount struct{ Successful, Failed, Unknown int }

var probeMetric = regexp.MustCompile(`^prober_probe_total\{(.*)\} ([0-9.e+]+)$`)

// kubeletProbes returns kubelet's counts of the probes of kind of container in the pod with
// UID uid.
func kubeletProbes(ctx context.Context, uid, container, kind string) (probeCount, error) {
	text, err := cl.KubeletGet(ctx, "/metrics/probes")
	if err != nil {
		return probeCount{}, err
	}
	var pc probeCount
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		m := probeMetric.FindStringSubmatch(sc.Text())
		if m == nil || !strings.Contains(m[1], `pod_uid="`+uid+`"`) || !strings.Contains(m[1], `container="`+container+`"`) || !strings.Contains(m[1], `probe_type="`+kind+`"`) {
			continue
		}
		v, err := strconv.ParseFloat(m[2], 64)
		if err != nil {
			return probeCount{}, fmt.Errorf("kubelet's %s: %w", sc.Text(), err)
		}
		switch {
		case strings.Contains(m[1], `result="successful"`):
			pc.Successful += int(v)
		case strings.Contains(m[1], `result="failed"`):
			pc.Failed += int(v)
		default:
			pc.Unknown += int(v)
		}
	}
	return pc, sc.Err()
}
