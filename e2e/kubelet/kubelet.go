// Package kubelet is a fake kubelet for end-to-end tests: the real kubelet plugin manager
// (k8s.io/kubernetes/pkg/kubelet/pluginmanager: plugin watcher, reconciler, operation executor,
// assembled as kubelet assembles them, manager.go) with recording handlers for the CSIPlugin,
// DRAPlugin and DevicePlugin types in place of the CSI volume plugin, the DRA manager and the
// device manager.
//
// Everything kubelet does on the registration socket — inotify on the registry directory,
// dial, GetInfo, ValidatePlugin, RegisterPlugin, NotifyRegistrationStatus, DeRegisterPlugin,
// per-path backoff and the 1 s reconciler — is kubelet's own code, of the version this package
// is linked with (see [Version]). Only the handlers are ours: they validate like kubelet's real
// handlers, check that the advertised endpoint accepts a connection, and record what they see.
package kubelet

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"google.golang.org/grpc"
	"k8s.io/apimachinery/pkg/util/version"
	"k8s.io/klog/v2"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// Options configure a [Kubelet]. The zero value is a kubelet that checks endpoints and logs
// nothing.
type Options struct {
	// Log receives the plugin manager's contextual log output (the plugin watcher's from kubelet
	// 1.35, the reconciler's and operation executor's too from 1.37) and the handlers' own
	// records. Nil discards both. What the linked kubelet does not log contextually goes to
	// klog's global logger (stderr) whatever this is: all of it on 1.34 and older.
	Log *slog.Logger
	// SkipEndpointCheck turns off the connect to the advertised endpoint that RegisterPlugin
	// makes by default, the way kubelet's CSI handler (NodeGetInfo) and device manager (dial)
	// reach the endpoint before they accept a plugin. For DRA the check is stricter than
	// kubelet, whose DRA manager connects lazily and accepts an endpoint that is not there yet.
	SkipEndpointCheck bool
	// EndpointTimeout bounds that connect. Zero means 1 s.
	EndpointTimeout time.Duration
	// NoPodResources leaves out the pod-resources API that kubelet serves beside its
	// plugins-registry directory (podresources.go): a kubelet too old, or not mounted.
	NoPodResources bool
	// CSINode, if set, records a CSI driver in the node's CSINode object (install) as kubelet's
	// CSI handler does while it registers the driver (nodeinfomanager's InstallCSIDriver,
	// after NodeGetInfo: its error fails the registration), and removes it (not install) when
	// kubelet deregisters the driver (UninstallCSIDriver). Nil: no CSINode is written.
	CSINode func(ctx context.Context, driver string, install bool) error
}

// Kubelet is a running plugin manager with recording handlers. Its methods are safe for
// concurrent use. A kubelet restart is Stop followed by Start on the same directory: the new
// Kubelet starts with empty state, like a restarted kubelet process, and registers again every
// socket it finds.
type Kubelet struct {
	dir             string
	log             *slog.Logger
	checkEndpoints  bool
	endpointTimeout time.Duration
	csiNode         func(ctx context.Context, driver string, install bool) error

	ctx    context.Context // cancelled by Stop: ends register delays, endpoint checks and (1.37) the reconciler
	cancel context.CancelFunc
	stopCh chan struct{} // closed by Stop: ends the plugin watcher and (1.36 and older) the reconciler
	pm     *pluginManager
	gate   *gate
	calls  sync.WaitGroup
	once   sync.Once

	mu      sync.Mutex
	stopped bool
	events  []Event
	fail    map[string]int           // name → registrations still to fail
	delay   map[string]time.Duration // name → RegisterPlugin delay
	csi     map[string]*csiDriver    // keyed by name, like kubelet's csiDrivers
	devices map[string][]string      // name → endpoints, like the device manager's clients (one before 1.37)
	dra     map[string][]string      // name → endpoints: DRA is keyed by (name, endpoint)
	// deviceCount: name → the devices its resource holds while registered (default 1).
	deviceCount map[string]int

	podResources     *grpc.Server // nil without the pod-resources API
	podResourcesDone chan struct{}
}

type csiDriver struct {
	endpoint string
	highest  *version.Version
	// registered is false while RegisterPlugin is still running: kubelet stores the driver
	// before it calls NodeGetInfo, so a second socket for the name fails validation already.
	registered bool
}

// Start runs the real plugin manager on registryDir (created if missing) with recording
// handlers for CSIPlugin, DRAPlugin and DevicePlugin. It returns once the plugin manager
// watches the directory and has walked what is already there. ctx bounds only the start-up and
// carries no cancellation into the kubelet: it runs until Stop.
func Start(ctx context.Context, registryDir string, opts Options) (*Kubelet, error) {
	if err := os.MkdirAll(registryDir, 0o755); err != nil {
		return nil, fmt.Errorf("start kubelet: %w", err)
	}
	log := opts.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	endpointTimeout := opts.EndpointTimeout
	if endpointTimeout == 0 {
		endpointTimeout = time.Second
	}
	kctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	k := &Kubelet{
		dir:             registryDir,
		log:             log,
		checkEndpoints:  !opts.SkipEndpointCheck,
		endpointTimeout: endpointTimeout,
		csiNode:         opts.CSINode,
		ctx:             kctx,
		cancel:          cancel,
		stopCh:          make(chan struct{}),
		fail:            map[string]int{},
		delay:           map[string]time.Duration{},
		csi:             map[string]*csiDriver{},
		devices:         map[string][]string{},
		dra:             map[string][]string{},
		deviceCount:     map[string]int{},
	}
	if !opts.NoPodResources {
		if err := k.servePodResources(); err != nil {
			cancel()
			return nil, fmt.Errorf("start kubelet: %w", err)
		}
	}

	k.gate = &gate{stop: k.stopCh}
	k.pm = newPluginManager(registryDir, k.gate)
	for _, typ := range []string{registerapi.CSIPlugin, registerapi.DRAPlugin, registerapi.DevicePlugin} {
		k.pm.rc.AddHandler(typ, handler{k: k, typ: typ})
	}
	// As the plugin manager's Run: the watcher first, which walks the directory before it
	// returns, then the reconciler. Both log through the contextual logger of kctx where the
	// linked kubelet does.
	lctx := klog.NewContext(kctx, logr.FromSlogHandler(log.Handler()))
	if err := startWatcher(lctx, k.pm.watcher, k.stopCh); err != nil {
		k.Stop()
		return nil, fmt.Errorf("start kubelet plugin manager on %s: %w", registryDir, err)
	}
	go runReconciler(lctx, k.pm.rc, k.stopCh)
	log.Debug("kubelet plugin manager started", "dir", registryDir, "version", Version())
	return k, nil
}

// Stop stops the plugin manager and blocks until no handler call is in progress; it cancels
// register delays, endpoint checks and a held pass (HoldPass). It is idempotent.
//
// What Stop cannot wait for: the plugin manager does not wait for its reconciler goroutine nor
// for the register and unregister operations already running (each a goroutine holding a
// connection to a registration socket). Every handler call that such an operation makes after
// Stop fails with "kubelet stopped" and is not recorded; the plugin may then receive a
// NotifyRegistrationStatus(false) from the stopped kubelet, which a real dead kubelet would
// never send. A registrar must treat it like any failure, which is safe.
func (k *Kubelet) Stop() {
	k.once.Do(func() {
		k.mu.Lock()
		k.stopped = true
		k.mu.Unlock()
		k.cancel()
		close(k.stopCh)
		k.calls.Wait()
		if k.podResources != nil {
			k.podResources.Stop()
			<-k.podResourcesDone
		}
		k.log.Debug("kubelet plugin manager stopped", "dir", k.dir)
	})
}

// Dir returns the plugins-registry directory this kubelet watches.
func (k *Kubelet) Dir() string { return k.dir }

// FailRegistrations makes the next n RegisterPlugin calls for name fail (after any delay set
// with SetRegisterDelay), the way a failing CSI NodeGetInfo or device-plugin dial would. n <= 0
// clears it.
func (k *Kubelet) FailRegistrations(name string, n int) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if n <= 0 {
		delete(k.fail, name)
		return
	}
	k.fail[name] = n
}

// SetRegisterDelay makes every RegisterPlugin call for name take at least d before it
// succeeds or fails, like a slow NodeGetInfo. d <= 0 clears it. Stop ends a delay early.
func (k *Kubelet) SetRegisterDelay(name string, d time.Duration) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if d <= 0 {
		delete(k.delay, name)
		return
	}
	k.delay[name] = d
}

// enter admits a handler call unless the kubelet is stopped. A true result must be paired with
// k.calls.Done().
func (k *Kubelet) enter() bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.stopped {
		return false
	}
	k.calls.Add(1)
	return true
}

var errStopped = errors.New("kubelet stopped")
