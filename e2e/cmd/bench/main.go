// Command bench measures multireg the way its users judge it, against kubelet's real plugin
// manager, for N drivers of mixed types (a third each of CSIPlugin, DRAPlugin and
// DevicePlugin), and prints one table with each figure's goal:
//
//   - time from starting `multireg run` to all N sockets published, and to all N registered
//     in kubelet;
//   - multireg's RSS and PSS, threads, goroutines and open fds, in total and per driver; its
//     peak RSS (VmHWM), and its RSS a minute after every driver is registered (-rss-at);
//   - its idle CPU with all N registered;
//   - reload: one driver's endpoint changed among N, from the write of the file to its new
//     socket and to its new registration, and how many of the other N-1 stayed untouched;
//   - recovery: kubelet rejects one driver once; the time from the rejection to the new
//     socket beyond the configured backoff interval, and, for a driver with multireg's default
//     backoff, the time from the rejection until kubelet registers it again; and for a CSI
//     driver with the default backoff that kubelet rejects once in the start-up burst, the
//     same (its retry must not wait behind the other drivers' first probes).
//
// The drivers file is multireg's defaults (every endpoint probed: waitForEndpoint), except
// the fixed backoff of the two drivers whose recovery overhead is measured.
//
// Kubelet's plugin manager runs in this process; the plugin endpoints run in another
// (cmd/endpoints) and multireg in a third, built without the race detector, so that
// multireg's figures are its own.
//
// Usage (from e2e/):
//
//	go run ./cmd/bench [-n 1,10,100,1000] [-idle 30s] [-out ../BENCHMARKS.md]
//
// With -out, the generated part of the file (between the markers <!-- bench:begin --> and
// <!-- bench:end -->) is replaced and the rest is kept; a file without markers is refused.
// MULTIREG_BIN (or -multireg) names a multireg binary to measure instead of building one.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"k8s.io/klog/v2"

	"multireg.dev/multireg/e2e/kubelet"
)

func main() {
	os.Exit(run())
}

func run() int {
	ns := flag.String("n", "1,10,100,1000", "driver counts to measure, comma-separated")
	out := flag.String("out", "", "write the results into this markdown file (between its bench markers)")
	idle := flag.Duration("idle", 30*time.Second, "idle-CPU window, with every driver registered")
	settle := flag.Duration("settle", 2500*time.Millisecond, "after a reload, how long to watch the other drivers for changes")
	timeout := flag.Duration("timeout", 5*time.Minute, "bound on each N's run, besides the idle window")
	bin := flag.String("multireg", os.Getenv("MULTIREG_BIN"), "multireg binary to measure (default: $MULTIREG_BIN, or build one without -race)")
	rssAt := flag.Duration("rss-at", time.Minute, "read multireg's RSS this long after every driver is registered, before /metrics is scraped (after the idle window, if that is longer); 0 skips it")
	gcWait := flag.Duration("gc-wait", 0, "after the idle window, wait up to this long for two more GC cycles of multireg (the runtime forces one every 2 min) and measure the settled footprint; 0 skips it")
	memLimit := flag.String("gomemlimit", "", "GOMEMLIMIT for multireg only, e.g. 57MiB (what it sets itself under a 64Mi container limit)")
	godebug := flag.String("godebug", "", "GODEBUG for multireg, e.g. gctrace=1 (its output ends in the log tail only)")
	tmpDir := flag.String("tmpdir", "", "where the registry, endpoint and config directories go (default: $TMPDIR or /tmp); e.g. /dev/shm to take the disk's file system out of the figures")
	profile := flag.String("profile", "", "measure a copy of multireg built with profiling, and save its profiles in this directory")
	apiServer := flag.String("node-condition", "", "turn multireg's node condition on, against this kube-apiserver binary (e2e/node/build-kube.sh builds it) and Debian's etcd: each N has a Node and a CSINode of its own, and kubelet records the CSI drivers there")
	flag.Parse()

	counts, err := parseNs(*ns)
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		return 2
	}
	if *profile != "" && *out != "" {
		fmt.Fprintln(os.Stderr, "bench: -profile measures a profiling copy of multireg: its figures do not belong in -out")
		return 2
	}
	progress := func(format string, args ...any) {
		fmt.Fprintf(os.Stderr, "%s bench: %s\n", time.Now().Format("15:04:05.000"), fmt.Sprintf(format, args...))
	}

	// Kubelet's reconciler logs every operation through klog: keep it off the output.
	klogFlags := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(klogFlags)
	_ = klogFlags.Set("logtostderr", "false")
	_ = klogFlags.Set("alsologtostderr", "false")
	_ = klogFlags.Set("stderrthreshold", "FATAL")
	klog.SetOutput(io.Discard)

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	e2eDir, err := moduleDir()
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		return 1
	}
	tmp, err := os.MkdirTemp("", "benchbin")
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		return 1
	}
	defer os.RemoveAll(tmp)

	o := options{idle: *idle, settle: *settle, gcWait: *gcWait, rssAt: *rssAt, timeout: *timeout, tmpDir: *tmpDir, progress: progress}
	if *apiServer != "" {
		cp, err := startAPI(ctx, tmp, *apiServer)
		if err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			return 1
		}
		defer cp.stop()
		o.api = cp
		progress("etcd and kube-apiserver ready: the node condition is on")
	}
	buildEnv := append(os.Environ(), "CGO_ENABLED=0")
	o.endpoints = filepath.Join(tmp, "endpoints")
	if err := buildGo(e2eDir, o.endpoints, buildEnv, "./cmd/endpoints"); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		return 1
	}
	root := filepath.Dir(e2eDir)
	built := *bin == ""
	switch {
	case *profile != "":
		if o.profileDir, err = filepath.Abs(*profile); err == nil {
			err = os.MkdirAll(o.profileDir, 0o755)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			return 1
		}
		o.multireg = filepath.Join(tmp, "multireg-pprof")
		progress("building multireg with profiling from %s", root)
		if err := buildProfiled(root, tmp, o.multireg, buildEnv); err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			return 1
		}
		built = false
	case built:
		// As `make build` builds it: static, stripped, no race detector.
		o.multireg = filepath.Join(tmp, "multireg")
		progress("building multireg from %s (CGO_ENABLED=0 -trimpath -tags grpcnotrace -ldflags='-s -w')", root)
		if err := buildGo(root, o.multireg, buildEnv, "-trimpath", "-tags", "grpcnotrace", "-ldflags", "-s -w -X main.version=bench", "./cmd/multireg"); err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			return 1
		}
	default:
		if o.multireg, err = filepath.Abs(*bin); err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			return 1
		}
	}
	// The node condition's agent, beside the binary the benchmark built, as in the image (a
	// binary given by -multireg, from make build, has its own there).
	if *apiServer != "" && filepath.Dir(o.multireg) == tmp {
		if err := buildAgent(root, tmp, buildEnv); err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			return 1
		}
	}
	o.env = os.Environ()
	var debug []string
	if *gcWait > 0 {
		debug = append(debug, "gctrace=1") // how the settled footprint counts collections
	}
	if *godebug != "" {
		debug = append(debug, *godebug)
	}
	if len(debug) > 0 {
		o.env = append(o.env, "GODEBUG="+strings.Join(debug, ","))
	}
	if *memLimit != "" {
		o.env = append(o.env, "GOMEMLIMIT="+*memLimit)
	}

	m := describeMachine(root, o.multireg, built)
	m.TmpDir = o.tmpDir
	if m.TmpDir == "" {
		m.TmpDir = os.TempDir()
	}
	m.TmpFS = fsType(m.TmpDir)
	progress("%s", m.oneLine())

	var results []result
	failed := false
	for _, n := range counts {
		if ctx.Err() != nil {
			break
		}
		progress("N=%d: start", n)
		r := runOne(ctx, n, o)
		if r.Err != nil {
			failed = true
			progress("N=%d: FAILED: %v", n, r.Err)
		}
		results = append(results, r)
	}

	report := renderReport(m, o, results)
	fmt.Print(report)
	if *out != "" && len(results) > 0 {
		if err := writeReport(*out, report); err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			return 1
		}
		progress("wrote %s", *out)
	}
	if failed || ctx.Err() != nil {
		return 1
	}
	return 0
}

func parseNs(s string) ([]int, error) {
	var ns []int
	for _, f := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			return nil, fmt.Errorf("-n: %q is not a positive count", f)
		}
		ns = append(ns, n)
	}
	return ns, nil
}

// moduleDir finds the e2e module: beside this source file, or the working directory.
func moduleDir() (string, error) {
	var candidates []string
	if _, file, _, ok := runtime.Caller(0); ok && filepath.IsAbs(file) {
		candidates = append(candidates, filepath.Join(filepath.Dir(file), "..", ".."))
	}
	if wd, err := os.Getwd(); err == nil {
		candidates = append(candidates, wd)
	}
	for _, dir := range candidates {
		b, err := os.ReadFile(filepath.Join(dir, "go.mod"))
		if err == nil && strings.Contains(string(b), "module multireg.dev/multireg/e2e\n") {
			return filepath.Clean(dir), nil
		}
	}
	return "", fmt.Errorf("cannot find the e2e module (run from e2e/)")
}

// machine describes where the figures come from.
type machine struct {
	CPUs        int
	CPUModel    string
	MemTotalMiB int64
	Kernel      string
	GoVersion   string
	Kubelet     string
	Multireg    string // `multireg version`, then how it was built (markdown)
	Commit      string // git describe of the product tree
	LoadAvg     string
	Date        string
	TmpDir      string // where the registry directory is
	TmpFS       string // its file system type
}

func describeMachine(root, bin string, built bool) machine {
	m := machine{CPUs: runtime.NumCPU(), Kubelet: kubelet.Version(), Date: time.Now().Format("2006-01-02 15:04 MST")}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range scanLines(string(b)) {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPUModel = strings.TrimSpace(v)
				break
			}
		}
	}
	if kv, err := readKV("/proc/meminfo"); err == nil {
		m.MemTotalMiB = kv["MemTotal"] / 1024
	}
	if b, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		m.Kernel = strings.TrimSpace(string(b))
	}
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		m.LoadAvg = strings.Join(strings.Fields(string(b))[:3], " ")
	}
	if b, err := exec.Command("go", "env", "GOVERSION").Output(); err == nil {
		m.GoVersion = strings.TrimSpace(string(b))
	}
	if b, err := exec.Command(bin, "version").CombinedOutput(); err == nil {
		m.Multireg = strings.Join(strings.Fields(string(b)), " ")
	}
	if built {
		m.Multireg += "`, built by the benchmark as `make build` does (CGO_ENABLED=0 -trimpath -tags grpcnotrace -ldflags '-s -w'), no -race"
	} else {
		m.Multireg += "`, " + displayPath(root, bin)
	}
	cmd := exec.Command("git", "describe", "--always", "--dirty")
	cmd.Dir = root
	if b, err := cmd.Output(); err == nil {
		m.Commit = strings.TrimSpace(string(b))
	}
	return m
}

// fsType returns the type of the file system that holds dir, from /proc/self/mounts.
func fsType(dir string) string {
	dir, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return "unknown"
	}
	b, err := os.ReadFile("/proc/self/mounts")
	if err != nil {
		return "unknown"
	}
	best, typ := "", "unknown"
	for _, line := range scanLines(string(b)) {
		f := strings.Fields(line)
		if len(f) < 3 {
			continue
		}
		mp := f[1]
		if (dir == mp || strings.HasPrefix(dir, strings.TrimSuffix(mp, "/")+"/")) && len(mp) >= len(best) {
			best, typ = mp, f[2]
		}
	}
	return typ
}

func (m machine) oneLine() string {
	return fmt.Sprintf("%d CPUs (%s), %d MiB, Linux %s, %s, kubelet %s, load %s, directories in %s (%s)",
		m.CPUs, m.CPUModel, m.MemTotalMiB, m.Kernel, m.GoVersion, m.Kubelet, m.LoadAvg, m.TmpDir, m.TmpFS)
}

// displayPath names bin for the report without the machine's directories: relative to the
// repository when it is inside it, else by its file name.
func displayPath(root, bin string) string {
	if rel, err := filepath.Rel(root, bin); err == nil && rel != ".." && !strings.HasPrefix(rel, "../") {
		return rel
	}
	return filepath.Base(bin) + " (outside the repository)"
}

// buildAgent builds the node condition's agent into dir, behind a script of its name that
// starts it without GODEBUG: the agent inherits multireg's environment and its stderr is
// multireg's, so its gctrace lines would count as multireg's collections (settledFootprint),
// and the settled footprint would be read before multireg's own second collection.
func buildAgent(root, dir string, env []string) error {
	bin := filepath.Join(dir, "multireg-nodecond.bin")
	if err := buildGo(root, bin, env, "-trimpath", "-tags", "grpcnotrace", "-ldflags", "-s -w", "./cmd/multireg-nodecond"); err != nil {
		return err
	}
	script := fmt.Sprintf("#!/bin/sh\nunset GODEBUG\nexec %q \"$@\"\n", bin)
	return os.WriteFile(filepath.Join(dir, "multireg-nodecond"), []byte(script), 0o755)
}
