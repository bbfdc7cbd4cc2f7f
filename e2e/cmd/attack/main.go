// Command attack floods multireg's registration sockets as a hostile local peer would, while
// kubelet's real plugin manager registers 30 drivers, and reports multireg's peak memory, whether
// it survived, and how long kubelet took to register a driver whose socket was recreated
// meanwhile.
//
//	attack -multireg bin/multireg -kind unfinished -conns 300 -size 1048576
//	attack -multireg bin/multireg -kind idle -conns 15000
//
// -kind unfinished: each connection starts a NotifyRegistrationStatus call whose request says
// it is -size bytes long and sends all but its last byte; -kind idle: each connection sends the
// HTTP/2 preface and SETTINGS, then nothing. A connection multireg closes is opened again: the
// attacker keeps -conns connections for -for. With -cgroup, multireg runs in that cgroup v2
// directory (created; its memory.max, or v1's memory.limit_in_bytes, set to -memory-max), so that it sets GOMEMLIMIT from it as
// it does in a pod.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"k8s.io/klog/v2"

	"multireg.dev/multireg/e2e/h2flood"
	"multireg.dev/multireg/e2e/internal/child"
	"multireg.dev/multireg/e2e/kubelet"
	"multireg.dev/multireg/e2e/plugins"
)

type options struct {
	bin, kind, cgroup, memoryMax string
	conns, size, drivers         int
	dur                          time.Duration
}

func main() {
	var o options
	flag.StringVar(&o.bin, "multireg", "bin/multireg", "the multireg binary")
	flag.StringVar(&o.kind, "kind", "idle", "idle (preface only) or unfinished (a request never finished)")
	flag.IntVar(&o.conns, "conns", 1000, "connections the attacker keeps open")
	flag.IntVar(&o.size, "size", 1<<20, "with -kind unfinished: the request's declared size")
	flag.IntVar(&o.drivers, "drivers", 30, "drivers registered meanwhile")
	flag.DurationVar(&o.dur, "for", 30*time.Second, "how long the attack lasts")
	flag.StringVar(&o.cgroup, "cgroup", "", "a memory cgroup directory (v2, or v1's) to run multireg in (created)")
	flag.StringVar(&o.memoryMax, "memory-max", "128M", "with -cgroup: its memory.max")
	flag.Parse()
	if err := run(o); err != nil {
		fmt.Fprintln(os.Stderr, "attack:", err)
		os.Exit(1)
	}
}

func run(o options) error {
	if o.kind != "idle" && o.kind != "unfinished" {
		return fmt.Errorf("-kind %q: idle or unfinished", o.kind)
	}
	bin, err := filepath.Abs(o.bin)
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "atk")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	klogFlags := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(klogFlags)
	klogFlags.Set("logtostderr", "false")
	klogFlags.Set("stderrthreshold", "FATAL")
	klog.SetOutput(discard{})

	reg := filepath.Join(dir, "reg")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	k, err := kubelet.Start(ctx, reg, kubelet.Options{})
	if err != nil {
		return err
	}
	defer k.Stop()
	names, cfg, stop, err := drivers(dir, reg, o.drivers)
	defer stop()
	if err != nil {
		return err
	}
	mr, pid, err := startMultireg(bin, cfg, dir, o)
	if err != nil {
		return err
	}
	defer mr.Stop(10 * time.Second)
	if err := until(60*time.Second, func() bool { return len(k.RegisteredNames()) == len(names) }); err != nil {
		return fmt.Errorf("the %d drivers were not registered before the attack: %d were", len(names), len(k.RegisteredNames()))
	}
	base := rss(pid)
	fmt.Printf("%d drivers registered; multireg's RSS %d KiB; attack %s, %d connections, for %s\n", len(names), base, o.kind, o.conns, o.dur)

	socks, _ := filepath.Glob(filepath.Join(reg, "*.sock"))
	a := &h2flood.Flood{Unfinished: o.kind == "unfinished", Size: o.size}
	actx, acancel := context.WithTimeout(ctx, o.dur)
	defer acancel()
	var wg sync.WaitGroup
	for i := range o.conns {
		wg.Go(func() { a.Hold(actx, socks[i%len(socks)]) })
	}
	peak, lat, alive := watch(actx, k, pid, reg, names)
	acancel()
	wg.Wait()
	fmt.Printf("multireg alive: %v; peak RSS %d KiB (before the attack %d KiB); cgroup memory.peak %s\n", alive, peak, base, cgroupPeak(o.cgroup))
	fmt.Printf("attacker: %d connections opened, %d closed by multireg\n", a.Opened.Load(), a.Closed.Load())
	fmt.Printf("re-registrations during the attack (socket removed -> kubelet registered the new one): %s\n", lat)
	if !alive {
		return fmt.Errorf("multireg died")
	}
	return nil
}

// drivers starts n endpoints and writes the drivers file; it returns the names.
func drivers(dir, reg string, n int) ([]string, string, func(), error) {
	var eps []*plugins.Endpoint
	stop := func() {
		for _, ep := range eps {
			ep.Stop()
		}
	}
	var names []string
	var b strings.Builder
	fmt.Fprintf(&b, "apiVersion: multireg.dev/v1alpha1\nkind: RegistrarConfig\nregistrationDir: %s\ndefaults:\n  backoff: {initialInterval: 200ms, maxInterval: 2s}\ndrivers:\n", reg)
	for i := range n {
		typ, name := "CSIPlugin", fmt.Sprintf("csi%d.example.com", i)
		switch i % 3 {
		case 1:
			typ, name = "DRAPlugin", fmt.Sprintf("dra%d.example.com", i)
		case 2:
			typ, name = "DevicePlugin", fmt.Sprintf("example.com/dev%d", i)
		}
		ep := filepath.Join(dir, "ep", strconv.Itoa(i)+".sock")
		e, err := plugins.Start(ep, typ, name)
		if err != nil {
			return nil, "", stop, err
		}
		eps = append(eps, e)
		names = append(names, name)
		fmt.Fprintf(&b, "  - {name: %s, type: %s, endpoint: %s}\n", name, typ, ep)
	}
	cfg := filepath.Join(dir, "cfg", "drivers.yaml")
	if err := os.MkdirAll(filepath.Dir(cfg), 0o755); err != nil {
		return nil, "", stop, err
	}
	return names, cfg, stop, os.WriteFile(cfg, []byte(b.String()), 0o644)
}

// startMultireg runs multireg, in o.cgroup if set; it returns the child and multireg's pid.
func startMultireg(bin, cfg, dir string, o options) (*child.Process, int, error) {
	args := []string{"run", "--config", cfg, "--http-endpoint", ""}
	cmd := exec.Command(bin, args...)
	if o.cgroup != "" {
		if err := os.MkdirAll(o.cgroup, 0o755); err != nil {
			return nil, 0, err
		}
		limit := filepath.Join(o.cgroup, "memory.max") // cgroup v2
		if _, err := os.Stat(limit); err != nil {
			limit = filepath.Join(o.cgroup, "memory.limit_in_bytes") // v1
		}
		if err := os.WriteFile(limit, []byte(o.memoryMax), 0o644); err != nil {
			return nil, 0, err
		}
		// The shell joins the cgroup, then becomes multireg: it starts there.
		cmd = exec.Command("sh", append([]string{"-c", `echo $$ > "$0/cgroup.procs" && exec "$@"`, o.cgroup, bin}, args...)...)
	}
	logf, err := os.Create(filepath.Join(dir, "multireg.log"))
	if err != nil {
		return nil, 0, err
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	if p := os.Getenv("ATTACK_LOG"); p != "" {
		logf.Close()
		if logf, err = os.Create(p); err != nil {
			return nil, 0, err
		}
		cmd.Stdout, cmd.Stderr = logf, logf
	}
	p, err := child.Start("multireg", cmd)
	if err != nil {
		return nil, 0, err
	}
	return p, cmd.Process.Pid, nil
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }

// until polls cond every 50 ms for at most d.
func until(d time.Duration, cond func() bool) error {
	end := time.Now().Add(d)
	for !cond() {
		if time.Now().After(end) {
			return fmt.Errorf("timed out")
		}
		time.Sleep(50 * time.Millisecond) // a tool's poll, not a test's synchronisation
	}
	return nil
}
