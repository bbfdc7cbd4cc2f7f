package kubelet

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/record"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager/cache"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager/operationexecutor"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager/pluginwatcher"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager/reconciler"
)

// The plugin manager is assembled here as pluginmanager.NewPluginManager assembles it
// (pkg/kubelet/pluginmanager/plugin_manager.go, the same from 1.33 to 1.37): kubelet's own
// desired and actual states of the world, operation executor and generator, reconciler (a pass
// every loopSleepDuration) and plugin watcher, with this package's handlers. What its Run adds
// is started by Start (startWatcher, runReconciler), but for the metrics collector, which
// nothing here scrapes. Assembled here, the states the reconciler reads pass through a gate:
// a test can hold a pass between its two loops (HoldPass), and a failed test can show kubelet's
// actual state (StateReport).

// loopSleepDuration is the reconciler's period (plugin_manager.go).
const loopSleepDuration = time.Second

// pluginManager is a plugin manager's parts.
type pluginManager struct {
	watcher *pluginwatcher.Watcher
	rc      reconciler.Reconciler
	asw     cache.ActualStateOfWorld // kubelet's own, not the gate's
}

func newPluginManager(dir string, g *gate) *pluginManager {
	asw := cache.NewActualStateOfWorld()
	dsw := cache.NewDesiredStateOfWorld()
	g.dsw = dsw
	rc := reconciler.NewReconciler(
		operationexecutor.NewOperationExecutor(operationexecutor.NewOperationGenerator(record.NewFakeRecorder(1000))),
		loopSleepDuration,
		gatedDesired{dsw, g},
		gatedActual{asw, g},
	)
	return &pluginManager{watcher: pluginwatcher.NewWatcher(dir, dsw), rc: rc, asw: asw}
}

// A reconcile pass (pkg/kubelet/pluginmanager/reconciler/reconciler.go, reconcile; the same
// from 1.33 to 1.37) reads the states in this order, on the reconciler's goroutine: the actual
// state's registrations (GetRegisteredPlugins); for each, whether the desired state holds its
// path (PluginExists) and, if it does, the desired state's every socket (GetPluginsToRegister),
// to find the path recreated since (another UUID): those it unregisters. Then, in a reading of
// its own (GetPluginsToRegister again), the sockets to register: those whose UUID the actual
// state does not hold. The gate counts the first loop's readings to tell the second's.

// gate is what the reconciler reads the states through.
type gate struct {
	dsw  cache.DesiredStateOfWorld
	stop <-chan struct{} // closed when the kubelet stops: a held pass goes on

	// guards: every field below. The reconciler's goroutine is the only one that reads the
	// states through the gate; HoldPass arms a hold from the test's.
	mu sync.Mutex
	// registered: the actual state's registrations as this pass began.
	registered []cache.PluginInfo
	// looks: readings of the desired state's sockets left to the first loop of this pass;
	// looked: the path of the registration the next one is about.
	looks  int
	looked string
	// hold: the hold armed, if any, and the UUID the first loop of this pass saw at its path
	// (seen: it looked at it).
	hold *Hold
	seen types.UID
}

// Hold is a reconcile pass to hold (HoldPass).
type Hold struct {
	path    string
	max     time.Duration
	holding chan struct{} // closed when a pass is held
	result  chan HoldResult
}

// Holding is closed once a pass is held: what the test does then happens between its loops.
func (h *Hold) Holding() <-chan struct{} { return h.holding }

// Result receives, once, what became of the pass held.
func (h *Hold) Result() <-chan HoldResult { return h.result }

// HoldResult is what became of a pass HoldPass held.
type HoldResult struct {
	// Changed: the plugin watcher saw the path change (another socket there, or none) while
	// the pass was held; false when max passed first, or the kubelet stopped.
	Changed bool
	// Held is how long the pass was held.
	Held time.Duration
}

type gatedActual struct {
	cache.ActualStateOfWorld
	g *gate
}

func (a gatedActual) GetRegisteredPlugins() []cache.PluginInfo {
	ps := a.ActualStateOfWorld.GetRegisteredPlugins()
	a.g.passBegins(ps)
	return ps
}

type gatedDesired struct {
	cache.DesiredStateOfWorld
	g *gate
}

func (d gatedDesired) PluginExists(path string) bool {
	ok := d.DesiredStateOfWorld.PluginExists(path)
	if ok {
		d.g.willLook(path)
	}
	return ok
}

func (d gatedDesired) GetPluginsToRegister() []cache.PluginInfo {
	return d.g.read()
}

func (g *gate) passBegins(registered []cache.PluginInfo) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.registered, g.looks, g.looked, g.seen = registered, 0, "", ""
}

func (g *gate) willLook(path string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.looks++
	g.looked = path
}

// read is a reading of the desired state's sockets: the first loop's, or the second's, which a
// hold armed for a path the first loop left registered waits before.
func (g *gate) read() []cache.PluginInfo {
	g.mu.Lock()
	if g.looks > 0 {
		g.looks--
		ps := g.dsw.GetPluginsToRegister()
		if g.hold != nil && g.looked == g.hold.path {
			g.seen = uuidAt(ps, g.looked)
		}
		g.mu.Unlock()
		return ps
	}
	h := g.hold
	var held types.UID
	if h != nil {
		held = uuidAt(g.registered, h.path)
	}
	if held == "" || g.seen != held {
		g.mu.Unlock() // no hold, or this pass unregisters its path (or does not hold it)
		return g.dsw.GetPluginsToRegister()
	}
	g.hold = nil
	g.mu.Unlock()
	close(h.holding)
	h.result <- g.wait(h.path, held, h.max)
	return g.dsw.GetPluginsToRegister()
}

// wait holds the pass until the desired state's socket at path is no longer uuid, for at most
// max. The plugin watcher updates the desired state from inotify, on its own goroutine.
func (g *gate) wait(path string, uuid types.UID, max time.Duration) HoldResult {
	start := time.Now()
	deadline := time.NewTimer(max)
	defer deadline.Stop()
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for {
		if uuidAt(g.dsw.GetPluginsToRegister(), path) != uuid {
			return HoldResult{Changed: true, Held: time.Since(start)}
		}
		select {
		case <-g.stop:
			return HoldResult{Held: time.Since(start)}
		case <-deadline.C:
			return HoldResult{Held: time.Since(start)}
		case <-tick.C:
		}
	}
}

func uuidAt(ps []cache.PluginInfo, path string) types.UID {
	for _, p := range ps {
		if p.SocketPath == path {
			return p.UUID
		}
	}
	return ""
}

// HoldPass makes the next reconcile pass that leaves path registered (kubelet's actual state
// holds a socket there, and the pass's first loop found the same socket in the desired state)
// wait between its two loops until the plugin watcher sees path change, or for at most max:
// a socket recreated at path meanwhile is registered in that pass before the one it replaced
// is unregistered, as when the recreation falls between the two loops of a pass by chance.
// One hold is armed at a time: a second one replaces the first.
func (k *Kubelet) HoldPass(path string, max time.Duration) *Hold {
	h := &Hold{path: path, max: max, holding: make(chan struct{}), result: make(chan HoldResult, 1)}
	k.gate.mu.Lock()
	defer k.gate.mu.Unlock()
	k.gate.hold = h
	return h
}

// StateReport describes, for a failed test's output, kubelet's actual state of the world (the
// registration of each socket path, as the plugin manager recorded it) and what the handlers
// hold; a handler's registration that no path of the actual state holds is marked: nothing
// will deregister it.
func (k *Kubelet) StateReport() string {
	var b strings.Builder
	byName := map[string][]string{}
	ps := k.pm.asw.GetRegisteredPlugins()
	slices.SortFunc(ps, func(a, b cache.PluginInfo) int { return strings.Compare(a.SocketPath, b.SocketPath) })
	b.WriteString("actual state of the world:")
	for _, p := range ps {
		fmt.Fprintf(&b, "\n\t%s: %q endpoint=%s uuid=%s", p.SocketPath, p.Name, p.Endpoint, p.UUID)
		byName[p.Name] = append(byName[p.Name], p.Endpoint)
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	b.WriteString("\nhandlers:")
	// CSI and, before 1.37, the device manager hold one registration per name, and deregister
	// it whatever the endpoint; DRA and 1.37's device manager one per (name, endpoint).
	held := func(typ, name string, eps []string, byEndpoint bool) {
		for _, ep := range eps {
			fmt.Fprintf(&b, "\n\t%s %q endpoint=%s", typ, name, ep)
			if byEndpoint && !slices.Contains(byName[name], ep) || !byEndpoint && len(byName[name]) == 0 {
				b.WriteString(" (no socket path holds it: never deregistered)")
			}
		}
	}
	for _, name := range slices.Sorted(maps.Keys(k.csi)) {
		if d := k.csi[name]; d.registered {
			held(registerapi.CSIPlugin, name, []string{d.endpoint}, false)
		}
	}
	for _, name := range slices.Sorted(maps.Keys(k.dra)) {
		held(registerapi.DRAPlugin, name, k.dra[name], true)
	}
	for _, name := range slices.Sorted(maps.Keys(k.devices)) {
		held(registerapi.DevicePlugin, name, k.devices[name], DevicePluginsKeyedByEndpoint())
	}
	return b.String()
}
