package kubelet

import (
	"context"
	"slices"
	"sync"

	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"
)

// CSINodeWriter is an Options.CSINode that records CSI drivers in the CSINode of node through
// client, as kubelet's nodeinfomanager does: each driver once, by name, with the node's name
// as its node ID; removed when kubelet deregisters it. The CSINode must exist (kubelet creates
// it when it starts). Its writes are one at a time: kubelet is the CSINode's one writer, and
// a thousand drivers registering at once must not fail each other's updates.
func CSINodeWriter(client kubernetes.Interface, node string) func(ctx context.Context, driver string, install bool) error {
	var mu sync.Mutex
	return func(ctx context.Context, driver string, install bool) error {
		mu.Lock()
		defer mu.Unlock()
		return retry.RetryOnConflict(retry.DefaultRetry, func() error {
			c, err := client.StorageV1().CSINodes().Get(ctx, node, metav1.GetOptions{})
			if err != nil {
				return err
			}
			ds := slices.DeleteFunc(c.Spec.Drivers, func(d storagev1.CSINodeDriver) bool { return d.Name == driver })
			if install {
				ds = append(ds, storagev1.CSINodeDriver{Name: driver, NodeID: node})
			}
			c.Spec.Drivers = ds
			_, err = client.StorageV1().CSINodes().Update(ctx, c, metav1.UpdateOptions{})
			return err
		})
	}
}
