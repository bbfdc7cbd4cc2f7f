package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"multireg.dev/multireg/e2e/internal/controlplane"
)

// conditionType is the node condition the benchmark has multireg keep (-node-condition).
const conditionType = "multireg.dev/PluginsRegistered"

// api is the control plane of -node-condition: etcd and kube-apiserver, and a client.
type api struct {
	cp     *controlplane.ControlPlane
	client kubernetes.Interface
}

// startAPI starts etcd and the kube-apiserver binary bin, their files in dir.
func startAPI(ctx context.Context, dir, bin string) (*api, error) {
	log, err := os.Create(filepath.Join(dir, "control-plane.log"))
	if err != nil {
		return nil, err
	}
	sctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	cp, err := controlplane.Start(sctx, controlplane.Options{Dir: filepath.Join(dir, "cp"), APIServer: bin, Node: "bench", Log: log})
	if err != nil {
		return nil, fmt.Errorf("control plane: %w", err)
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", cp.Kubeconfig)
	if err != nil {
		cp.Stop()
		return nil, err
	}
	// kubelet's CSI handler writes the CSINode at each of a thousand registrations: no
	// client-side limit of the benchmark's own may slow it.
	cfg.QPS, cfg.Burst = 1000, 2000
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		cp.Stop()
		return nil, err
	}
	return &api{cp: cp, client: client}, nil
}

func (a *api) stop() { a.cp.Stop() }

// node creates a Node and its CSINode (with no driver, as kubelet creates it).
func (a *api) node(ctx context.Context, name string) error {
	if _, err := a.client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{}); err != nil {
		return err
	}
	_, err := a.client.StorageV1().CSINodes().Create(ctx, &storagev1.CSINode{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec:       storagev1.CSINodeSpec{Drivers: []storagev1.CSINodeDriver{}},
	}, metav1.CreateOptions{})
	return err
}

// deleteNode deletes the Node and its CSINode.
func (a *api) deleteNode(name string) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	a.client.StorageV1().CSINodes().Delete(ctx, name, metav1.DeleteOptions{})
	a.client.CoreV1().Nodes().Delete(ctx, name, metav1.DeleteOptions{})
}
