package testkit

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"google.golang.org/grpc"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
)

// PodResources plays kubelet's pod-resources API on a real socket: GetAllocatableResources
// lists the devices the test says kubelet's device manager holds.
type PodResources struct {
	podresourcesv1.UnimplementedPodResourcesListerServer
	ep *Endpoint

	// guards: devices, calls, fail.
	mu      sync.Mutex
	devices map[string]int
	calls   int
	fail    []error // the answers of the next calls, then the devices again
}

// StartPodResources serves the pod-resources API at path until the test ends.
func StartPodResources(t testing.TB, path string) *PodResources {
	t.Helper()
	p := &PodResources{devices: map[string]int{}}
	p.ep = ServeEndpoint(t, path, func(s *grpc.Server) { podresourcesv1.RegisterPodResourcesListerServer(s, p) })
	return p
}

// Set makes kubelet hold n allocatable devices of resource (0: none, and not listed).
func (p *PodResources) Set(resource string, n int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if n == 0 {
		delete(p.devices, resource)
		return
	}
	p.devices[resource] = n
}

// FailNext makes the next calls fail with errs, one each, as kubelet's rate limit
// (ResourceExhausted) or a slow kubelet would; later calls answer again.
func (p *PodResources) FailNext(errs ...error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.fail = append(p.fail, errs...)
}

// Calls counts the GetAllocatableResources calls answered.
func (p *PodResources) Calls() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.calls
}

// Path is where the API is served.
func (p *PodResources) Path() string { return p.ep.Path() }

// Stop stops serving and removes the socket, as a kubelet that stops.
func (p *PodResources) Stop() { p.ep.Stop() }

// GetAllocatableResources implements the API: each resource's devices, one entry per device
// the way kubelet lists them for devices without topology.
func (p *PodResources) GetAllocatableResources(context.Context, *podresourcesv1.AllocatableResourcesRequest) (*podresourcesv1.AllocatableResourcesResponse, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls++
	if len(p.fail) > 0 {
		err := p.fail[0]
		p.fail = p.fail[1:]
		return nil, err
	}
	resp := &podresourcesv1.AllocatableResourcesResponse{}
	for name, n := range p.devices {
		ids := make([]string, n)
		for i := range ids {
			ids[i] = fmt.Sprintf("dev%d", i)
		}
		resp.Devices = append(resp.Devices, &podresourcesv1.ContainerDevices{ResourceName: name, DeviceIds: ids})
	}
	return resp, nil
}
