// Command demo shows multireg at work on this machine, with no cluster: kubelet's real plugin
// manager watches a registry directory, three fake drivers (CSI, DRA, device plugin) serve
// their endpoints, and multireg registers all three from one drivers file. Kubelet is told to
// fail the CSI driver's first registration, so the demo also shows multireg recreating the
// socket and the registration succeeding on the retry.
//
// The drivers file is examples/local/config.yaml, with its /tmp/multireg-demo prefix moved to
// a fresh temporary directory.
//
// Usage: demo -multireg bin/multireg -config examples/local/config.yaml
package main

import (
	"bytes"
	"cmp"
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"k8s.io/klog/v2"
	"sigs.k8s.io/yaml"

	"multireg.dev/multireg/e2e/internal/child"
	"multireg.dev/multireg/e2e/kubelet"
	"multireg.dev/multireg/e2e/plugins"
)

func main() {
	bin := flag.String("multireg", "bin/multireg", "path to the multireg binary")
	cfgPath := flag.String("config", "examples/local/config.yaml", "the drivers file to run; its paths under /tmp/multireg-demo are moved to a temporary directory")
	timeout := flag.Duration("timeout", 60*time.Second, "give up if the drivers are not all registered by then")
	flag.Parse()
	if err := run(*bin, *cfgPath, *timeout, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
}

// localPrefix is where examples/local/config.yaml puts everything.
const localPrefix = "/tmp/multireg-demo"

// drivers is what the demo reads of the drivers file: the drivers to serve and to watch.
type drivers struct {
	Drivers []struct {
		Name     string `json:"name"`
		Type     string `json:"type"`
		Endpoint string `json:"endpoint"`
	} `json:"drivers"`
}

func run(bin, cfgPath string, timeout time.Duration, out io.Writer) error {
	bin, err := filepath.Abs(bin)
	if err != nil {
		return err
	}
	if _, err := os.Stat(bin); err != nil {
		return fmt.Errorf("multireg binary: %w (run `make build` first)", err)
	}
	dir, err := os.MkdirTemp("", "demo")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	tmpl, err := os.ReadFile(cfgPath)
	if err != nil {
		return err
	}
	content := strings.ReplaceAll(string(tmpl), localPrefix, dir)
	var ds drivers
	if err := yaml.Unmarshal([]byte(content), &ds); err != nil || len(ds.Drivers) == 0 {
		return fmt.Errorf("%s: no drivers to show (%v)", cfgPath, err)
	}
	reg := filepath.Join(dir, "plugins_registry")
	var print sync.Mutex
	say := func(who, format string, args ...any) {
		print.Lock()
		defer print.Unlock()
		fmt.Fprintf(out, "%-9s| %s\n", who, fmt.Sprintf(format, args...))
	}

	// The plugin manager logs through klog: show its lines in the timeline too.
	klogFlags := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(klogFlags)
	klogFlags.Set("logtostderr", "false")
	klogFlags.Set("alsologtostderr", "false")
	klogFlags.Set("skip_headers", "true")
	klogFlags.Set("stderrthreshold", "FATAL")
	// Every severity is written to the INFO output (once); the others stay unset.
	klog.SetOutputBySeverity("INFO", child.Lines(func(line []byte) { say("kubelet", "%s", bytes.TrimSpace(line)) }))
	defer klog.Flush()

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	k, err := kubelet.Start(ctx, reg, kubelet.Options{})
	if err != nil {
		return err
	}
	defer k.Stop()
	say("demo", "kubelet %s plugin manager watches %s", kubelet.Version(), reg)

	for _, d := range ds.Drivers {
		ep, err := plugins.Start(d.Endpoint, d.Type, d.Name)
		if err != nil {
			return err
		}
		defer ep.Stop()
		say("demo", "%s %s serves %s", d.Type, d.Name, ep.Path)
	}
	failing := ds.Drivers[0].Name
	k.FailRegistrations(failing, 1)
	say("demo", "kubelet will fail the first registration of %s", failing)

	cfg := filepath.Join(dir, "drivers.yaml")
	if err := os.WriteFile(cfg, []byte(content), 0o644); err != nil {
		return err
	}
	say("demo", "drivers file %s (%s in %s):", cfgPath, localPrefix, dir)
	for _, line := range strings.Split(strings.TrimSpace(content), "\n") {
		if !strings.HasPrefix(strings.TrimSpace(line), "#") && strings.TrimSpace(line) != "" {
			say("demo", "  %s", line)
		}
	}

	cmd := exec.Command(bin, "run", "--config", cfg, "--http-endpoint", "")
	logs := child.Lines(func(line []byte) { say("multireg", "%s", line) })
	cmd.Stdout, cmd.Stderr = logs, logs
	mr, err := child.Start("multireg", cmd)
	if err != nil {
		return err
	}
	// SIGTERM: multireg leaves its sockets and kubelet keeps the plugins. Stop runs once; the
	// deferred call stops multireg if the demo ends early.
	const grace = 30 * time.Second
	defer mr.Stop(grace)
	say("demo", "$ multireg run --config %s", cfg)

	// Print kubelet's handler calls as they happen, until every plugin is registered.
	seen := 0
	deadline := time.Now().Add(timeout)
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for range tick.C {
		events := k.Events()
		for _, e := range events[seen:] {
			msg := fmt.Sprintf("%s %s %s", e.Kind, e.Type, e.Name)
			if e.Err != "" {
				msg += ": " + e.Err
			}
			say("kubelet", "%s", msg)
		}
		seen = len(events)
		done := true
		for _, d := range ds.Drivers {
			done = done && k.Registered(d.Name)
		}
		if done {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not every plugin registered within %s", timeout)
		}
	}
	say("demo", "registered in kubelet: %s", strings.Join(k.RegisteredNames(), ", "))
	say("demo", "stopping multireg with SIGTERM: sockets stay, kubelet keeps the plugins")
	if err := cmp.Or(mr.Stop(grace), mr.Err()); err != nil {
		return fmt.Errorf("multireg: %w", err)
	}
	say("demo", "done")
	return nil
}
