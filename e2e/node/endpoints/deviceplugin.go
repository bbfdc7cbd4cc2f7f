package endpoints

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// DeviceOptions describes the device plugin StartDevicePlugin serves.
type DeviceOptions struct {
	// ResourceName is the extended resource the plugin advertises, e.g. "example.com/widget".
	// The kubelet takes it from the registration, not from this endpoint, and rejects a name
	// without a domain; StartDevicePlugin rejects it too, so a test fails before the kubelet does.
	ResourceName string
	// Devices is how many devices ListAndWatch reports, with IDs "dev-0" … "dev-<Devices-1>",
	// all Healthy.
	Devices int
}

// DevicePlugin is a device plugin endpoint serving the v1beta1 DevicePlugin service. After a
// registration through the plugin watcher, the kubelet dials it (blocking, 10 s), calls
// GetDevicePluginOptions and then holds one ListAndWatch stream open until it deregisters the
// plugin; that stream ending marks the resource's devices unhealthy.
type DevicePlugin struct {
	srv      *server
	resource string
	quit     chan struct{} // closed by Stop: ListAndWatch streams return
	quitOnce sync.Once

	mu           sync.Mutex
	devices      int
	changed      chan struct{} // closed and replaced by SetDevices
	opened, open int
}

// StartDevicePlugin serves a device plugin on the unix socket path until Stop.
func StartDevicePlugin(path string, opts DeviceOptions) (*DevicePlugin, error) {
	if domain, name, ok := strings.Cut(opts.ResourceName, "/"); !ok || domain == "" || name == "" {
		return nil, fmt.Errorf("device plugin endpoint: resourceName: %q: must be <domain>/<name>", opts.ResourceName)
	}
	if opts.Devices < 0 {
		return nil, fmt.Errorf("device plugin endpoint %q: devices: %d: must not be negative", opts.ResourceName, opts.Devices)
	}
	p := &DevicePlugin{
		resource: opts.ResourceName,
		quit:     make(chan struct{}),
		devices:  opts.Devices,
		changed:  make(chan struct{}),
	}
	srv, err := serve(path, func(s *grpc.Server) {
		pluginapi.RegisterDevicePluginServer(s, devicePluginServer{p: p})
	})
	if err != nil {
		return nil, fmt.Errorf("device plugin endpoint %q: %w", opts.ResourceName, err)
	}
	p.srv = srv
	return p, nil
}

// Path returns the socket path the endpoint serves on.
func (p *DevicePlugin) Path() string { return p.srv.path }

// RegisterWithKubelet registers the plugin itself, as most device plugins do: Register on the
// device-plugin API's own socket, kubeletSocket (pluginapi.KubeletSocket on a node), naming the
// endpoint by its file name in that socket's directory, where the plugin's socket must be.
func (p *DevicePlugin) RegisterWithKubelet(ctx context.Context, kubeletSocket string) error {
	if filepath.Dir(p.Path()) != filepath.Dir(kubeletSocket) {
		return fmt.Errorf("device plugin %s: register with %s: the endpoint must be in its directory", p.Path(), kubeletSocket)
	}
	conn, err := grpc.NewClient("unix:"+kubeletSocket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version:      pluginapi.Version,
		Endpoint:     filepath.Base(p.Path()),
		ResourceName: p.resource,
	})
	if err != nil {
		return fmt.Errorf("device plugin %s: Register on %s: %w", p.resource, kubeletSocket, err)
	}
	return nil
}

// Stop ends every ListAndWatch stream, stops serving and removes the socket if it is still the
// endpoint's own. It blocks until the server's goroutines have exited and is idempotent.
func (p *DevicePlugin) Stop() {
	p.quitOnce.Do(func() { close(p.quit) })
	p.srv.stop()
}

// ListAndWatchStreams reports how many ListAndWatch streams have been opened since start and how
// many are open now.
func (p *DevicePlugin) ListAndWatchStreams() (opened, open int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.opened, p.open
}

// SetDevices changes the device count to n and sends the new list on every open ListAndWatch
// stream. It does not wait for the sends.
func (p *DevicePlugin) SetDevices(n int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.devices = max(n, 0)
	close(p.changed)
	p.changed = make(chan struct{})
}

// listAndWatch sends the device list on send at once and again after every SetDevices, until
// ctx is done or Stop is called.
func (p *DevicePlugin) listAndWatch(ctx context.Context, send func(*pluginapi.ListAndWatchResponse) error) error {
	p.mu.Lock()
	p.opened++
	p.open++
	p.mu.Unlock()
	defer func() {
		p.mu.Lock()
		p.open--
		p.mu.Unlock()
	}()
	for {
		p.mu.Lock()
		n, changed := p.devices, p.changed
		p.mu.Unlock()
		if err := send(&pluginapi.ListAndWatchResponse{Devices: deviceList(n)}); err != nil {
			return err
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return nil
		case <-p.quit:
			return nil
		}
	}
}

// deviceList returns n healthy devices "dev-0" … "dev-<n-1>".
func deviceList(n int) []*pluginapi.Device {
	devs := make([]*pluginapi.Device, n)
	for i := range devs {
		devs[i] = &pluginapi.Device{ID: fmt.Sprintf("dev-%d", i), Health: pluginapi.Healthy}
	}
	return devs
}

// devicePluginServer is the gRPC face of a DevicePlugin. The options ask for neither
// GetPreferredAllocation nor PreStartContainer, so the kubelet does not call them; they answer
// anyway, with nothing.
type devicePluginServer struct {
	pluginapi.UnimplementedDevicePluginServer
	p *DevicePlugin
}

func (devicePluginServer) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

func (s devicePluginServer) ListAndWatch(_ *pluginapi.Empty, stream pluginapi.DevicePlugin_ListAndWatchServer) error {
	return s.p.listAndWatch(stream.Context(), stream.Send)
}

func (devicePluginServer) GetPreferredAllocation(_ context.Context, req *pluginapi.PreferredAllocationRequest) (*pluginapi.PreferredAllocationResponse, error) {
	resp := &pluginapi.PreferredAllocationResponse{}
	for range req.GetContainerRequests() {
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerPreferredAllocationResponse{})
	}
	return resp, nil
}

func (devicePluginServer) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	resp := &pluginapi.AllocateResponse{}
	for range req.GetContainerRequests() {
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerAllocateResponse{})
	}
	return resp, nil
}

func (devicePluginServer) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}
