package kubelet

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"slices"

	"google.golang.org/grpc"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
)

// kubelet serves its pod-resources API at <root>/pod-resources/kubelet.sock, beside the
// plugins-registry directory <root>/plugins_registry. This one answers
// GetAllocatableResources from the device plugins its handlers hold, as kubelet's device
// manager would: each registered resource with its devices (SetDevices; one by default), none
// for a resource whose client it dropped.

// PodResourcesSocket is where a kubelet on registryDir serves its pod-resources API.
func PodResourcesSocket(registryDir string) string {
	return filepath.Join(filepath.Dir(registryDir), "pod-resources", "kubelet.sock")
}

type podResources struct {
	podresourcesv1.UnimplementedPodResourcesListerServer
	k *Kubelet
}

// servePodResources serves the API until Stop.
func (k *Kubelet) servePodResources() error {
	path := PodResourcesSocket(k.dir)
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	l, err := net.Listen("unix", path)
	if err != nil {
		return fmt.Errorf("pod-resources API: %w", err)
	}
	srv := grpc.NewServer()
	podresourcesv1.RegisterPodResourcesListerServer(srv, &podResources{k: k})
	k.podResources = srv
	k.podResourcesDone = make(chan struct{})
	go func() {
		defer close(k.podResourcesDone)
		srv.Serve(l)
	}()
	return nil
}

// SetDevices makes a registered device plugin's resource hold n devices (default 1).
func (k *Kubelet) SetDevices(name string, n int) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.deviceCount[name] = n
}

// AllocatableDevices is what the pod-resources API says of resource: the devices kubelet's
// device manager holds for it.
func (k *Kubelet) AllocatableDevices(resource string) int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.allocatable(resource)
}

// allocatable is AllocatableDevices; its caller holds k.mu.
func (k *Kubelet) allocatable(resource string) int {
	if len(k.devices[resource]) == 0 {
		return 0
	}
	if n, ok := k.deviceCount[resource]; ok {
		return n
	}
	return 1
}

func (p *podResources) GetAllocatableResources(context.Context, *podresourcesv1.AllocatableResourcesRequest) (*podresourcesv1.AllocatableResourcesResponse, error) {
	k := p.k
	k.mu.Lock()
	defer k.mu.Unlock()
	resp := &podresourcesv1.AllocatableResourcesResponse{}
	names := make([]string, 0, len(k.devices))
	for name := range k.devices {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		n := k.allocatable(name)
		if n == 0 {
			continue
		}
		ids := make([]string, n)
		for i := range ids {
			ids[i] = fmt.Sprintf("%s-%d", name, i)
		}
		resp.Devices = append(resp.Devices, &podresourcesv1.ContainerDevices{ResourceName: name, DeviceIds: ids})
	}
	return resp, nil
}
