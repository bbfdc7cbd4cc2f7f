// Package nodecondition runs the built multireg against kubelet's real plugin manager and a
// real API server (etcd and kube-apiserver 1.37, e2e/internal/controlplane): the node
// condition it keeps on its Node, the startup taint it removes, and what a failing API server
// changes (nothing of the registrations). The plugin manager's CSI handler records each CSI
// driver in the node's CSINode as kubelet's does (kubelet.Options.CSINode); e2e/node checks the
// same on a real kubelet.
//
// kube-apiserver's binary is MULTIREG_E2E_KUBE_APISERVER (`make e2e` builds it with
// e2e/node/build-kube.sh), etcd is found in PATH (Debian's etcd-server).
package nodecondition

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"multireg.dev/multireg/e2e/internal/controlplane"
	"multireg.dev/multireg/e2e/mrproc"
)

// api is the control plane every test of the package shares: each test has a Node of its own.
var api struct {
	cp     *controlplane.ControlPlane
	client kubernetes.Interface
}

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	if _, err := mrproc.Binary(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	bin := os.Getenv("MULTIREG_E2E_KUBE_APISERVER")
	if bin == "" {
		fmt.Fprintln(os.Stderr, "MULTIREG_E2E_KUBE_APISERVER is not set: the path of a kube-apiserver binary (make e2e builds it: e2e/node/build-kube.sh DIR 1.37 kube-apiserver)")
		return 1
	}
	dir, err := os.MkdirTemp("", "cp")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	log, err := os.Create(dir + "/control-plane.log")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer log.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	start := time.Now()
	cp, err := controlplane.Start(ctx, controlplane.Options{Dir: dir, APIServer: bin, Node: "node", Log: log})
	if err != nil {
		fmt.Fprintln(os.Stderr, "control plane:", err)
		return 1
	}
	defer cp.Stop()
	fmt.Fprintf(os.Stderr, "etcd and kube-apiserver ready in %s\n", time.Since(start).Round(time.Millisecond))
	cfg, err := clientcmd.BuildConfigFromFlags("", cp.Kubeconfig)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	cfg.QPS, cfg.Burst = 100, 200
	api.cp = cp
	if api.client, err = kubernetes.NewForConfig(cfg); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return m.Run()
}
