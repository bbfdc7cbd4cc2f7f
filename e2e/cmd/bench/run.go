package main

import (
	"bufio"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"multireg.dev/multireg/e2e/internal/child"
	"multireg.dev/multireg/e2e/kubelet"
)

// recoveryBackoff is the configured backoff interval of the driver that kubelet rejects once.
const recoveryBackoff = time.Second

// driver is one entry of the drivers file.
type driver struct {
	name, typ string
	endpoint  string // as served by the endpoints process
	alt       string // a second endpoint of the same driver, for the reload ("" if none)
	fixed     bool   // backoff {initialInterval: 1s, randomizationFactor: 0}
}

func (d driver) socketName() string {
	return strings.NewReplacer("/", "_").Replace(d.name) + "-reg.sock"
}

// mixed returns n drivers, a third of each type, each endpoint in a directory of its own as
// on a node (/var/lib/kubelet/plugins/<driver>/csi.sock).
func mixed(n int, epDir string) []driver {
	ds := make([]driver, n)
	for i := range ds {
		ep := filepath.Join(epDir, strconv.Itoa(i), "s.sock")
		switch i % 3 {
		case 0:
			ds[i] = driver{name: fmt.Sprintf("csi%d.example.com", i), typ: "CSIPlugin", endpoint: ep}
		case 1:
			ds[i] = driver{name: fmt.Sprintf("dra%d.example.com", i), typ: "DRAPlugin", endpoint: ep}
		case 2:
			ds[i] = driver{name: fmt.Sprintf("example.com/dev%d", i), typ: "DevicePlugin", endpoint: ep}
		}
	}
	return ds
}

func configContent(reg string, ds []driver) string {
	var b strings.Builder
	fmt.Fprintf(&b, "apiVersion: multireg.dev/v1alpha1\nkind: RegistrarConfig\nregistrationDir: %s\n", reg)
	if len(ds) == 0 {
		b.WriteString("drivers: []\n") // an empty "drivers:" is null, which multireg refuses
	} else {
		b.WriteString("drivers:\n")
	}
	for _, d := range ds {
		fmt.Fprintf(&b, "  - name: %s\n    type: %s\n    endpoint: %s\n", d.name, d.typ, d.endpoint)
		if d.fixed {
			fmt.Fprintf(&b, "    backoff: {initialInterval: %s, randomizationFactor: 0}\n", recoveryBackoff)
		}
	}
	return b.String()
}

// writeAtomic writes content to a temporary file beside path and renames it over path. It
// returns the time just before the rename: when the new content becomes visible.
func writeAtomic(path, content string) (time.Time, error) {
	tmp := filepath.Join(filepath.Dir(path), ".bench.tmp")
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		return time.Time{}, err
	}
	t := time.Now()
	if err := os.Rename(tmp, path); err != nil {
		return time.Time{}, err
	}
	return t, nil
}

// recoveryResult is one driver's recovery after one rejection by kubelet.
type recoveryResult struct {
	Overhead     time.Duration // kubelet's RegisterFailed → new socket, minus the backoff
	FromLog      time.Duration // "registration failed" log → new socket, minus the backoff
	RetryIn      string        // the wait multireg logged
	Reregistered time.Duration // new socket → kubelet's Register
	Total        time.Duration // kubelet's RegisterFailed → kubelet's Register
}

// result is one N's figures. Durations are zero when not measured.
type result struct {
	N   int
	Err error

	FirstSocket, Published, Registered time.Duration // from the start of `multireg run`
	Validate                           time.Duration // `multireg validate` of the file, median of 5
	StartCPU                           cpuShare      // CPU time used until all sockets were published

	FP             footprint // after the idle window
	RSSAfterScrape int64     // KiB, right after the first /metrics scrape
	// RSSAt: KiB, RSSAtAfter after all were registered (rssAt, or the idle window if that is
	// longer), before any /metrics scrape (0: not measured).
	RSSAt                                    int64
	RSSAtAfter                               time.Duration
	Goroutines, HeapInuse, StackInuse, GoSys float64 // from /metrics (bytes)

	IdleWindow  time.Duration
	IdleCPU     float64 // % of one core, from utime+stime
	IdleRunNs   int64   // on-CPU time over the window from schedstat, in ns (finer than ticks)
	IdleWakeups float64 // context switches per second
	IdleCalls   int     // kubelet handler calls during the window (0 expected)
	SysBusy     float64 // whole machine, % of all cores, minus multireg and the benchmark
	BenchCPU    float64 // the benchmark process (kubelet included), % of one core

	// After two more garbage collections (the runtime forces one every 2 minutes when idle):
	// what stays once transient buffers are freed and returned.
	Settled                    footprint
	SettledHeap, SettledStacks float64
	SettledAfter               time.Duration // since all were registered
	SettledGC                  string        // multireg's last gctrace line
	SettledErr                 error

	ReloadApplied    time.Duration // write → the driver's new socket
	ReloadLogged     time.Duration // write → "config reloaded" (multireg's ms stamp)
	ReloadRegistered time.Duration // write → kubelet's Register with the new endpoint
	Others           int
	Untouched        int

	Recovery    recoveryResult // a CSI driver: its probe includes a gRPC GetPluginInfo
	RecoveryDev recoveryResult // a device plugin: its probe is a connect
	// RecoveryDefault: a DRA driver with multireg's default backoff, from kubelet's rejection
	// until it registers the driver again.
	RecoveryDefault recoveryResult
	// StartRecovery: a CSI driver with multireg's default backoff that kubelet rejects once
	// in the start-up burst, from the rejection until kubelet registers it again (its retry
	// must not queue behind the other drivers' first probes); StartRetryIn the wait multireg
	// logged.
	StartRecovery time.Duration
	StartRetryIn  string
	// AgentFP: the node condition's agent process (-node-condition), read with FP.
	AgentFP footprint
	// Health: the drivers' liveness checks under load.
	Health   healthResult
	Warnings map[string]int // multireg's WARN and ERROR log lines, by level and message
}

type options struct {
	api                 *api // the node condition's API server; nil: the condition is off
	multireg, endpoints string
	env                 []string // multireg's environment
	profileDir          string   // with -profile: where profiles go ("" for none)
	tmpDir              string   // where each N's directory goes ("": os.TempDir())
	idle, settle        time.Duration
	gcWait              time.Duration // bound on waiting for two more GC cycles (0: skip)
	rssAt               time.Duration // after all are registered, when to read the RSS (0: skip)
	timeout             time.Duration // each N, besides the idle window
	progress            func(format string, args ...any)
}

var httpClient = &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}

// runOne measures multireg with n drivers. Everything it starts is stopped and removed before
// it returns, whatever happens.
func runOne(parent context.Context, n int, o options) (res result) {
	res.N = n
	if err := measure(parent, n, o, &res); err != nil {
		res.Err = err
	}
	return res
}

func measure(parent context.Context, n int, o options, res *result) (err error) {
	ctx, cancel := context.WithTimeout(parent, o.timeout+o.idle+o.gcWait)
	defer cancel()
	say := func(format string, args ...any) { o.progress("N=%d: "+format, append([]any{n}, args...)...) }

	dir, err := os.MkdirTemp(o.tmpDir, "b") // short: unix socket paths are at most 107 bytes
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	reg, cfgDir, epDir := filepath.Join(dir, "r"), filepath.Join(dir, "c"), filepath.Join(dir, "e")
	if err := os.Mkdir(cfgDir, 0o755); err != nil {
		return err
	}

	ds := mixed(n, epDir)
	reloadI := 0                  // a CSI driver: its probe (GetPluginInfo) is the slowest
	recoverI, recoverDev := 0, -1 // the last CSI driver, the last device plugin
	recoverDefault := -1          // the last DRA driver, with the default backoff
	for i := range ds {
		switch ds[i].typ {
		case "CSIPlugin":
			recoverI = i
		case "DevicePlugin":
			recoverDev = i
		case "DRAPlugin":
			recoverDefault = i
		}
	}
	// A CSI driver kubelet rejects once in the start-up burst: the first of the file after
	// the reloaded one, with the default backoff, rejected while most drivers' first probes
	// are still to come (none with fewer than three CSI drivers).
	startReject := -1
	for i := range ds {
		if ds[i].typ == "CSIPlugin" && i != reloadI && i != recoverI {
			startReject = i
			break
		}
	}
	ds[reloadI].alt = filepath.Join(filepath.Dir(ds[reloadI].endpoint), "t.sock")
	ds[recoverI].fixed = true
	if recoverDev >= 0 {
		ds[recoverDev].fixed = true
	}
	names := make([]string, n)
	sockets := make([]string, n)
	for i, d := range ds {
		names[i] = d.name
		sockets[i] = d.socketName()
	}

	// Kubelet's real plugin manager, in this process.
	var kopts kubelet.Options
	var condArgs []string
	if o.api != nil {
		node := fmt.Sprintf("bench-%d", n)
		if err := o.api.node(ctx, node); err != nil {
			return err
		}
		defer o.api.deleteNode(node)
		kopts.CSINode = kubelet.CSINodeWriter(o.api.client, node)
		condArgs = []string{"--node-condition", conditionType, "--node-name", node, "--kubeconfig", o.api.cp.Kubeconfig}
	}
	k, err := kubelet.Start(ctx, reg, kopts)
	if err != nil {
		return err
	}
	defer k.Stop()

	// The endpoints, in a process of their own.
	var list strings.Builder
	for _, d := range ds {
		fmt.Fprintf(&list, "%s %s %s\n", d.endpoint, d.typ, d.name)
		if d.alt != "" {
			fmt.Fprintf(&list, "%s %s %s\n", d.alt, d.typ, d.name)
		}
	}
	listPath := filepath.Join(dir, "endpoints.txt")
	if err := os.WriteFile(listPath, []byte(list.String()), 0o644); err != nil {
		return err
	}
	eps, err := startEndpoints(o.endpoints, listPath)
	if err != nil {
		return err
	}
	defer func() {
		if serr := eps.stop(10 * time.Second); serr != nil && err == nil {
			err = fmt.Errorf("endpoints: %w", serr)
		}
	}()
	if err := eps.waitReady(60 * time.Second); err != nil {
		return err
	}

	w, err := watchDir(reg)
	if err != nil {
		return err
	}
	defer w.Close()

	cfg := filepath.Join(cfgDir, "drivers.yaml")
	if _, err := writeAtomic(cfg, configContent(reg, ds)); err != nil {
		return err
	}

	// How long reading the file takes multireg (process start included): the bulk of a
	// reload after its debounce.
	if res.Validate, err = timeValidate(ctx, o.multireg, cfg); err != nil {
		return err
	}

	// multireg run.
	var prof *profiler
	if o.profileDir != "" {
		prof = &profiler{dir: o.profileDir, n: n}
	}
	cpu0, err := startCPU(eps.PID())
	if err != nil {
		return err
	}
	if startReject >= 0 {
		k.FailRegistrations(ds[startReject].name, 1)
	}
	t0 := time.Now()
	// The health endpoint, where the liveness checks are measured (phase 6): nothing runs there
	// until they are.
	healthAddr, err := freeAddr()
	if err != nil {
		return err
	}
	mr, err := startMultireg(o.multireg, cfg, append(slices.Clip(o.env), prof.env()...), append(condArgs, "--health-endpoint", healthAddr)...)
	if err != nil {
		return err
	}
	defer func() {
		res.Warnings = mr.logs.problems()
		if serr := cmp.Or(mr.Stop(10*time.Second), mr.Err()); serr != nil && err == nil {
			err = fmt.Errorf("multireg: %w", serr)
		}
	}()
	if prof != nil {
		prof.mr = mr
		defer func() {
			for _, perr := range prof.wait() {
				say("profile: %v", perr)
			}
		}()
	}
	wait := func(timeout, tick time.Duration, what string, cond func() bool) error {
		return waitUntil(ctx, mr, timeout, tick, what, cond)
	}

	// 1. Start-up: all sockets published, all registered.
	var first, last time.Time
	if err := wait(60*time.Second, 2*time.Millisecond, "all sockets published", func() bool {
		var seen int
		last, seen = w.allAfter(sockets, t0)
		return seen == n
	}); err != nil {
		return err
	}
	if err := w.state(); err != nil {
		return err
	}
	// Who had the CPUs meanwhile: is the start-up bound by CPU, and whose?
	if cpu1, err := startCPU(eps.PID()); err == nil {
		if mrTicks, err := cpuTicks(mr.PID()); err == nil {
			cpu1.multireg = mrTicks
			res.StartCPU = cpu1.minus(cpu0)
		}
	}
	for _, s := range sockets {
		if at, ok := w.firstAfter(s, t0); ok && (first.IsZero() || at.Before(first)) {
			first = at
		}
	}
	res.FirstSocket, res.Published = first.Sub(t0), last.Sub(t0)
	say("first socket %v, all %d published %v", res.FirstSocket.Round(time.Millisecond), n, res.Published.Round(time.Millisecond))

	if err := wait(120*time.Second, 5*time.Millisecond, "all registered in kubelet", func() bool {
		for _, name := range names {
			if !k.Registered(name) {
				return false
			}
		}
		return true
	}); err != nil {
		return err
	}
	lastReg := t0
	for i, name := range names {
		if i == startReject {
			continue // registered a retry later: timed below
		}
		for _, e := range k.EventsFor(name) {
			if e.Kind == kubelet.EventRegister {
				if e.Time.After(lastReg) {
					lastReg = e.Time
				}
				break
			}
		}
	}
	res.Registered = lastReg.Sub(t0)
	say("all registered in kubelet %v", res.Registered.Round(time.Millisecond))
	if startReject >= 0 {
		if err := startRecovery(ctx, mr, k, ds[startReject].name, t0, res); err != nil {
			return err
		}
		say("a CSI driver rejected in the start-up burst registered again %v after the rejection (multireg waited %s)",
			res.StartRecovery.Round(time.Millisecond), res.StartRetryIn)
	}
	prof.stopCPU()

	// 2. multireg agrees (/readyz), then the idle window.
	var addr string
	if err := wait(10*time.Second, 5*time.Millisecond, "the HTTP address in the log", func() bool {
		addr = mr.httpAddr()
		return addr != ""
	}); err != nil {
		return err
	}
	if err := wait(60*time.Second, 20*time.Millisecond, "/readyz 200", func() bool {
		code, _, _ := get(addr, "/readyz")
		return code == http.StatusOK
	}); err != nil {
		return err
	}
	if err := idleWindow(ctx, mr, k, o.idle, res); err != nil {
		return err
	}
	say("idle CPU %.3f%% of a core over %v (%.1f wake-ups/s); machine busy %.1f%% otherwise",
		res.IdleCPU, res.IdleWindow.Round(time.Millisecond), res.IdleWakeups, res.SysBusy)

	// 3. Footprint, after the idle window: the steady state; and rssAt after registration,
	// before anything scrapes /metrics.
	if o.rssAt > 0 {
		if err := window(ctx, mr, time.Until(lastReg.Add(o.rssAt))); err != nil {
			return err
		}
		fp, err := readFootprint(mr.PID())
		if err != nil {
			return err
		}
		res.RSSAt, res.RSSAtAfter = fp.RSS, time.Since(lastReg)
		say("RSS %v after all were registered: %d KiB", res.RSSAtAfter.Round(time.Second), res.RSSAt)
	}
	if o.api != nil {
		// The node condition's agent, multireg's child: its own process, its own memory.
		if pid, ok := child.Named(mr.PID(), "multireg-nodecond"); ok {
			res.AgentFP, _ = readFootprint(pid)
		}
	}
	if res.FP, err = readFootprint(mr.PID()); err != nil {
		return err
	}
	code, body, err := get(addr, "/metrics")
	if err != nil || code != http.StatusOK {
		return fmt.Errorf("GET /metrics: %d %v", code, err)
	}
	m := parseMetrics(body)
	res.Goroutines, res.HeapInuse, res.StackInuse, res.GoSys = m["go_goroutines"], m["go_memstats_heap_inuse_bytes"], m["go_memstats_stack_inuse_bytes"], m["go_memstats_sys_bytes"]
	if fp, err := readFootprint(mr.PID()); err == nil {
		res.RSSAfterScrape = fp.RSS
	}
	say("RSS %d KiB, PSS %d KiB, %d threads, %.0f goroutines, %d fds", res.FP.RSS, res.FP.PSS, res.FP.Threads, res.Goroutines, res.FP.FDs)
	prof.save("/debug/pprof/heap", "heap.pprof")
	prof.save("/debug/pprof/goroutine?debug=1", "goroutines.txt")
	prof.save("/debug/pprof/trace?seconds=10", "idle.trace") // who wakes up while idle
	if o.gcWait > 0 {
		if err := settledFootprint(ctx, mr, addr, o.gcWait, res); err != nil {
			res.SettledErr = err
			say("no settled footprint: %v", err)
		} else {
			res.SettledAfter = time.Since(lastReg)
			say("after two more GCs (%v after registration): RSS %d KiB, PSS %d KiB",
				res.SettledAfter.Round(time.Second), res.Settled.RSS, res.Settled.PSS)
		}
		prof.save("/debug/pprof/heap", "heap-settled.pprof")
	}

	// 4. Reload: one driver's endpoint changes.
	prof.cpu(2*time.Second, "reload.cpu.pprof")
	prof.trace(2*time.Second, "reload.trace")
	if err := reload(ctx, mr, k, w, reg, cfg, ds, reloadI, o.settle, res); err != nil {
		return fmt.Errorf("reload: %w", err)
	}
	say("reload applied %v after the write (logged %v), registered again %v; %d/%d others untouched",
		res.ReloadApplied.Round(100*time.Microsecond), res.ReloadLogged, res.ReloadRegistered.Round(time.Millisecond), res.Untouched, res.Others)

	// 5. Recovery: kubelet rejects one driver once.
	if err := recovery(ctx, mr, k, w, reg, cfg, ds, recoverI, prof, &res.Recovery); err != nil {
		return fmt.Errorf("recovery: %w", err)
	}
	say("recovery overhead of a CSI driver %v after kubelet's rejection (%v after multireg's log line)",
		res.Recovery.Overhead.Round(10*time.Microsecond), res.Recovery.FromLog.Round(time.Millisecond))
	if recoverDev >= 0 {
		if err := recovery(ctx, mr, k, w, reg, cfg, ds, recoverDev, prof, &res.RecoveryDev); err != nil {
			return fmt.Errorf("recovery of a device plugin: %w", err)
		}
		say("recovery overhead of a device plugin %v after kubelet's rejection (%v after multireg's log line)",
			res.RecoveryDev.Overhead.Round(10*time.Microsecond), res.RecoveryDev.FromLog.Round(time.Millisecond))
	}
	if recoverDefault >= 0 {
		if err := recovery(ctx, mr, k, w, reg, cfg, ds, recoverDefault, prof, &res.RecoveryDefault); err != nil {
			return fmt.Errorf("recovery with the default backoff: %w", err)
		}
		say("recovery of a DRA driver with the default backoff: registered again %v after kubelet's rejection (multireg waited %s)",
			res.RecoveryDefault.Total.Round(time.Millisecond), res.RecoveryDefault.RetryIn)
	}

	// 6. The drivers' liveness checks: healthWorkers at once, for healthWindow.
	if err := healthChecks(ctx, healthAddr, ds, res); err != nil {
		return fmt.Errorf("health checks: %w", err)
	}
	say("liveness checks: %d in %v by %d clients at once, p50 %v, p99 %v, %d failed",
		res.Health.Checks, healthWindow, healthWorkers, res.Health.P50, res.Health.P99, res.Health.Failed)
	return nil
}

// The liveness checks' load: healthWorkers clients at once, each asking GET /healthz/<driver>
// of CSI drivers in turn (a new connection each time, as kubelet's probes do), for healthWindow.
const (
	healthWorkers = 100
	healthWindow  = 5 * time.Second
)

// healthResult is what the liveness checks measured.
type healthResult struct {
	Checks, Failed int
	P50, P99, Max  time.Duration
}

// healthChecks measures the liveness checks of the CSI drivers of ds at addr.
func healthChecks(ctx context.Context, addr string, ds []driver, res *result) error {
	var csiNames []string
	for _, d := range ds {
		if d.typ == "CSIPlugin" {
			csiNames = append(csiNames, d.name)
		}
	}
	if len(csiNames) == 0 {
		return nil
	}
	var mu sync.Mutex
	var took []time.Duration
	failed := 0
	end := time.Now().Add(healthWindow)
	var wg sync.WaitGroup
	for w := range healthWorkers {
		wg.Go(func() {
			client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
			for i := w; time.Now().Before(end) && ctx.Err() == nil; i += healthWorkers {
				start := time.Now()
				resp, err := client.Get("http://" + addr + "/healthz/" + csiNames[i%len(csiNames)])
				d := time.Since(start)
				ok := err == nil && resp.StatusCode == http.StatusOK
				if resp != nil {
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
				mu.Lock()
				took = append(took, d)
				if !ok {
					failed++
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if len(took) == 0 {
		return errors.New("no check made")
	}
	slices.Sort(took)
	res.Health = healthResult{Checks: len(took), Failed: failed, P50: took[len(took)/2], P99: took[len(took)*99/100], Max: took[len(took)-1]}
	return nil
}

// cpuShare is CPU time, in ticks of 1/userHZ s, by consumer.
type cpuShare struct {
	multireg, bench, endpoints, machine, total int64 // machine: all CPUs busy; total: all CPUs
}

func startCPU(endpointsPID int) (cpuShare, error) {
	var c cpuShare
	var err error
	if c.bench, err = cpuTicks(0); err != nil {
		return c, err
	}
	if c.endpoints, err = cpuTicks(endpointsPID); err != nil {
		return c, err
	}
	c.machine, c.total, err = systemCPU()
	return c, err
}

func (c cpuShare) minus(o cpuShare) cpuShare {
	return cpuShare{c.multireg - o.multireg, c.bench - o.bench, c.endpoints - o.endpoints, c.machine - o.machine, c.total - o.total}
}

// idleWindow measures multireg's CPU time and wake-ups over d, with everything registered and
// nothing happening, and what else the machine did meanwhile.
func idleWindow(ctx context.Context, mr *multireg, k *kubelet.Kubelet, d time.Duration, res *result) error {
	pid := mr.PID()
	calls0 := len(k.Events())
	sb0, st0, err := systemCPU()
	if err != nil {
		return err
	}
	self0, err := cpuTicks(0)
	if err != nil {
		return err
	}
	cpu0, err := cpuTicks(pid)
	if err != nil {
		return err
	}
	sw0, err := ctxSwitches(pid)
	if err != nil {
		return err
	}
	run0, err := runTime(pid)
	if err != nil {
		return err
	}
	start := time.Now()

	// A measurement window, not a synchronisation: nothing is awaited but the time.
	if err := window(ctx, mr, d); err != nil {
		return err
	}

	cpu1, err := cpuTicks(pid)
	if err != nil {
		return err
	}
	sw1, err := ctxSwitches(pid)
	if err != nil {
		return err
	}
	run1, err := runTime(pid)
	if err != nil {
		return err
	}
	elapsed := time.Since(start)
	self1, err := cpuTicks(0)
	if err != nil {
		return err
	}
	sb1, st1, err := systemCPU()
	if err != nil {
		return err
	}
	secs := elapsed.Seconds()
	res.IdleWindow = elapsed
	res.IdleCPU = float64(cpu1-cpu0) / userHZ / secs * 100
	res.IdleWakeups = float64(sw1-sw0) / secs
	res.IdleRunNs = run1 - run0
	res.BenchCPU = float64(self1-self0) / userHZ / secs * 100
	res.IdleCalls = len(k.Events()) - calls0
	if st1 > st0 {
		others := (sb1 - sb0) - (cpu1 - cpu0) - (self1 - self0)
		res.SysBusy = max(0, float64(others)/float64(st1-st0)*100)
	}
	return nil
}

// settledFootprint waits (up to bound) for multireg to run two more garbage collections —
// the first moves sync.Pool contents to the victim cache, the second frees them — and for its
// RSS to stop falling as the scavenger returns the freed memory, then reads the footprint.
// Collections are counted from multireg's GODEBUG=gctrace=1 lines, not by scraping /metrics,
// which would allocate in multireg and be what triggers them.
func settledFootprint(ctx context.Context, mr *multireg, addr string, bound time.Duration, res *result) error {
	gc0, _ := mr.logs.gc()
	if gc0 == 0 {
		// The runtime forces a collection only two minutes after the last one: a process
		// that never collected never will while idle, and has no garbage to return.
		return errNoGC
	}
	if err := waitUntil(ctx, mr, bound, time.Second, "two more GC cycles (gctrace)", func() bool {
		n, _ := mr.logs.gc()
		return n >= gc0+2
	}); err != nil {
		return err
	}
	// The RSS has settled when it has not fallen for 5 s in a row.
	var lastRSS int64
	var steady int
	if err := waitUntil(ctx, mr, time.Minute, time.Second, "RSS to settle", func() bool {
		fp, err := readFootprint(mr.PID())
		if err != nil {
			return false
		}
		if lastRSS != 0 && fp.RSS >= lastRSS {
			steady++
		} else {
			steady = 0
		}
		lastRSS = fp.RSS
		return steady >= 5
	}); err != nil {
		return err
	}
	fp, err := readFootprint(mr.PID())
	if err != nil {
		return err
	}
	res.Settled = fp
	_, res.SettledGC = mr.logs.gc()
	if code, body, err := get(addr, "/metrics"); err == nil && code == http.StatusOK {
		m := parseMetrics(body)
		res.SettledHeap, res.SettledStacks = m["go_memstats_heap_inuse_bytes"], m["go_memstats_stack_inuse_bytes"]
	}
	return nil
}

var errNoGC = errors.New("no garbage collection has run since the start: nothing to settle")

// timeValidate runs `multireg validate` on the file five times and returns the median time.
func timeValidate(ctx context.Context, bin, cfg string) (time.Duration, error) {
	var ds []time.Duration
	for range 5 {
		cmd := exec.CommandContext(ctx, bin, "validate", "--config", cfg)
		start := time.Now()
		out, err := cmd.CombinedOutput()
		if err != nil {
			return 0, fmt.Errorf("multireg validate: %v\n%s", err, out)
		}
		ds = append(ds, time.Since(start))
	}
	slices.Sort(ds)
	return ds[len(ds)/2], nil
}

// fileID identifies one socket file: inode and change time (an inode number alone is often
// reused by the next file).
type fileID struct {
	ino   uint64
	ctime syscall.Timespec
}

func statID(path string) (fileID, error) {
	var st syscall.Stat_t
	if err := syscall.Lstat(path, &st); err != nil {
		return fileID{}, err
	}
	if st.Mode&syscall.S_IFMT != syscall.S_IFSOCK {
		return fileID{}, fmt.Errorf("%s is not a socket", path)
	}
	return fileID{ino: st.Ino, ctime: st.Ctim}, nil
}

func reload(ctx context.Context, mr *multireg, k *kubelet.Kubelet, w *dirWatch, reg, cfg string, ds []driver, ri int, settle time.Duration, res *result) error {
	ids := make(map[string]fileID, len(ds))
	counts := make(map[string]kubelet.Counts, len(ds))
	for _, d := range ds {
		id, err := statID(filepath.Join(reg, d.socketName()))
		if err != nil {
			return err
		}
		ids[d.name], counts[d.name] = id, k.Counts(d.name)
	}
	changed := slices.Clone(ds)
	target := &changed[ri]
	target.endpoint, target.alt = target.alt, target.endpoint
	sock := filepath.Join(reg, target.socketName())

	tw, err := writeAtomic(cfg, configContent(reg, changed))
	if err != nil {
		return err
	}
	var applied time.Time
	if err := waitUntil(ctx, mr, 30*time.Second, time.Millisecond, "the changed driver's new socket", func() bool {
		var ok bool
		applied, ok = w.firstAfter(target.socketName(), tw)
		return ok
	}); err != nil {
		return err
	}
	if err := w.state(); err != nil {
		return err
	}
	if id, err := statID(sock); err != nil || id == ids[target.name] {
		return fmt.Errorf("socket %s: same identity after the reload (%v)", sock, err)
	}
	res.ReloadApplied = applied.Sub(tw)

	regs := counts[target.name].Registrations
	var registered time.Time
	if err := waitUntil(ctx, mr, 30*time.Second, 5*time.Millisecond, "the changed driver registered again", func() bool {
		if k.Counts(target.name).Registrations <= regs {
			return false
		}
		for _, e := range k.EventsFor(target.name) {
			if e.Kind == kubelet.EventRegister && e.Endpoint == target.endpoint && !e.Time.Before(tw) {
				registered = e.Time
				return k.Registered(target.name)
			}
		}
		return false
	}); err != nil {
		return err
	}
	res.ReloadRegistered = registered.Sub(tw)
	// multireg logs this once it has applied the change, which may be after the new socket.
	if r, ok := mr.logs.find("config reloaded", "", tw); ok {
		res.ReloadLogged = r.Time.Sub(tw).Round(time.Millisecond)
	}

	// Give anything that should not happen time to show: kubelet's reconciler passes once
	// a second. An observation window, not a synchronisation.
	if err := window(ctx, mr, settle); err != nil {
		return err
	}
	for _, d := range ds {
		if d.name == target.name {
			continue
		}
		res.Others++
		id, err := statID(filepath.Join(reg, d.socketName()))
		if err == nil && id == ids[d.name] && k.Counts(d.name) == counts[d.name] {
			res.Untouched++
		}
	}
	// Later phases use the new config.
	copy(ds, changed)
	return nil
}

// startRecovery times the registration of the driver named name that kubelet rejected once
// in the start-up burst (from t0): from the rejection to kubelet's next Register.
func startRecovery(ctx context.Context, mr *multireg, k *kubelet.Kubelet, name string, t0 time.Time, res *result) error {
	var rejected, again time.Time
	if err := waitUntil(ctx, mr, 30*time.Second, 5*time.Millisecond, "the driver rejected at start-up registered again", func() bool {
		for _, e := range k.EventsFor(name) {
			switch {
			case e.Kind == kubelet.EventRegisterFailed && rejected.IsZero():
				rejected = e.Time
			case e.Kind == kubelet.EventRegister && !rejected.IsZero():
				again = e.Time
				return k.Registered(name)
			}
		}
		return false
	}); err != nil {
		return err
	}
	res.StartRecovery = again.Sub(rejected)
	if r, ok := mr.logs.find("registration failed", name, t0); ok {
		res.StartRetryIn = retryIn(r)
	}
	return nil
}

// retryIn is the wait a "registration failed" line logged.
func retryIn(r logRecord) string {
	switch v := r.Fields["retryIn"].(type) {
	case string:
		return v
	case float64: // log/slog's JSON handler writes a duration in nanoseconds
		return time.Duration(v).String()
	}
	return ""
}

// recovery makes kubelet reject one driver once and times multireg's new socket. The driver
// leaves the drivers file (kubelet deregisters it) and comes back, so that its loop starts
// afresh and the rejection is its first failure, whose backoff is the configured initial
// interval whatever happened to the driver before. (Removing its socket by hand instead gave,
// once in a loaded run, a rejection preceded by another failure and a doubled interval; the
// logged retryIn is checked anyway.)
func recovery(ctx context.Context, mr *multireg, k *kubelet.Kubelet, w *dirWatch, reg, cfg string, ds []driver, ri int, prof *profiler, res *recoveryResult) error {
	d := ds[ri]
	sock := filepath.Join(reg, d.socketName())
	without := slices.Delete(slices.Clone(ds), ri, ri+1)
	if _, err := writeAtomic(cfg, configContent(reg, without)); err != nil {
		return err
	}
	if err := waitUntil(ctx, mr, 30*time.Second, 5*time.Millisecond, "the driver deregistered", func() bool {
		_, err := os.Lstat(sock)
		return os.IsNotExist(err) && !k.Registered(d.name)
	}); err != nil {
		return err
	}

	k.FailRegistrations(d.name, 1)
	prof.trace(3*time.Second, "recovery-"+d.typ+".trace")
	back, err := writeAtomic(cfg, configContent(reg, ds))
	if err != nil {
		return err
	}
	var rejected time.Time
	if err := waitUntil(ctx, mr, 30*time.Second, time.Millisecond, "kubelet's rejection", func() bool {
		for _, e := range k.EventsFor(d.name) {
			if e.Kind == kubelet.EventRegisterFailed && !e.Time.Before(back) {
				rejected = e.Time
				return true
			}
		}
		return false
	}); err != nil {
		return err
	}
	var recreated time.Time
	if err := waitUntil(ctx, mr, 30*time.Second, time.Millisecond, "the socket recreated after the rejection", func() bool {
		var ok bool
		recreated, ok = w.firstAfter(d.socketName(), rejected)
		return ok
	}); err != nil {
		return err
	}
	if err := w.state(); err != nil {
		return err
	}
	if r, ok := mr.logs.find("registration failed", d.name, rejected); ok {
		res.RetryIn = retryIn(r)
		if d.fixed {
			// multireg stamps milliseconds; the new socket's time is truncated alike.
			res.FromLog = recreated.Truncate(time.Millisecond).Sub(r.Time) - recoveryBackoff
		}
	}
	if d.fixed {
		res.Overhead = recreated.Sub(rejected) - recoveryBackoff
	}
	if d.fixed && res.RetryIn != recoveryBackoff.String() {
		return fmt.Errorf("multireg logged a backoff of %q after the rejection, not the configured %v", res.RetryIn, recoveryBackoff)
	}
	var again time.Time
	if err := waitUntil(ctx, mr, 30*time.Second, 5*time.Millisecond, "the rejected driver registered again", func() bool {
		for _, e := range k.EventsFor(d.name) {
			if e.Kind == kubelet.EventRegister && e.Time.After(recreated) {
				again = e.Time
				return k.Registered(d.name)
			}
		}
		return false
	}); err != nil {
		return err
	}
	res.Reregistered = again.Sub(recreated)
	res.Total = again.Sub(rejected)
	return nil
}

// waitUntil polls cond every tick until it is true; it fails when timeout passes, ctx ends or
// multireg exits.
func waitUntil(ctx context.Context, mr *multireg, timeout, tick time.Duration, what string, cond func() bool) error {
	if cond() {
		return nil
	}
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	t := time.NewTicker(tick)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			if cond() {
				return nil
			}
		case <-deadline.C:
			if cond() {
				return nil
			}
			return fmt.Errorf("timed out after %v waiting for %s; multireg's last log lines:\n%s", timeout, what, mr.logs.Tail())
		case <-ctx.Done():
			return fmt.Errorf("waiting for %s: %w", what, context.Cause(ctx))
		case <-mr.Done():
			return fmt.Errorf("waiting for %s: %w", what, mr.exitError())
		}
	}
}

func get(addr, path string) (int, string, error) {
	resp, err := httpClient.Get("http://" + addr + path)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// parseMetrics reads the samples without labels of a Prometheus text exposition.
func parseMetrics(body string) map[string]float64 {
	m := map[string]float64{}
	sc := bufio.NewScanner(strings.NewReader(body))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' || strings.ContainsRune(line, '{') {
			continue
		}
		name, v, ok := strings.Cut(line, " ")
		if !ok {
			continue
		}
		if f, err := strconv.ParseFloat(strings.TrimSpace(v), 64); err == nil {
			m[name] = f
		}
	}
	return m
}

// window lets d pass (a measurement or observation window, not a synchronisation); it fails
// when ctx ends or multireg exits first.
func window(ctx context.Context, mr *multireg, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-mr.Done():
		return mr.exitError()
	}
}

// freeAddr is an address on 127.0.0.1 with a port free now.
func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}
