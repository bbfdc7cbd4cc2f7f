package faults

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"multireg.dev/multireg/e2e/mrproc"
)

// What the kernel (/proc) and the runtime say about the multireg processes.

// pids returns the ids of the multireg processes that run with the drivers file cfg.
func pids(t testing.TB, cfg string) []int {
	t.Helper()
	bin, err := mrproc.Binary()
	if err != nil {
		t.Fatal(err)
	}
	dirs, err := filepath.Glob("/proc/[0-9]*")
	if err != nil {
		t.Fatal(err)
	}
	var out []int
	for _, d := range dirs {
		b, err := os.ReadFile(filepath.Join(d, "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
		if len(args) < 2 || args[0] != bin || args[1] != "run" {
			continue
		}
		for i, a := range args {
			if a == "--config" && i+1 < len(args) && args[i+1] == cfg {
				pid, _ := strconv.Atoi(filepath.Base(d))
				out = append(out, pid)
				break
			}
		}
	}
	return out
}

// pidOf returns the id of the one multireg process running with the drivers file cfg.
func pidOf(t testing.TB, cfg string) int {
	t.Helper()
	ps := pids(t, cfg)
	if len(ps) != 1 {
		t.Fatalf("%d multireg processes run with %s, want 1: %v", len(ps), cfg, ps)
	}
	return ps[0]
}

// resources is what a process holds: open fds and inotify watches, and its goroutines.
type resources struct {
	goroutines, fds, watches int
}

func (r resources) String() string {
	return fmt.Sprintf("%d goroutines, %d fds, %d inotify watches", r.goroutines, r.fds, r.watches)
}

// usage reads the resources of the multireg process p (pid): goroutines from /metrics
// (go_goroutines), fds from /proc/PID/fd, inotify watches from the "inotify wd:" lines of
// /proc/PID/fdinfo.
func usage(t testing.TB, p *mrproc.Process, pid int) resources {
	t.Helper()
	var r resources
	r.goroutines = int(mrproc.Metric(p.Metrics(t), "go_goroutines"))
	fdDir := fmt.Sprintf("/proc/%d/fd", pid)
	fds, err := os.ReadDir(fdDir)
	if err != nil {
		t.Fatal(err)
	}
	r.fds = len(fds)
	for _, fd := range fds {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/fdinfo/%s", pid, fd.Name()))
		if err != nil {
			continue // closed meanwhile
		}
		r.watches += bytes.Count(b, []byte("inotify wd:"))
	}
	return r
}

// goroutineDump makes the process print its goroutines (SIGQUIT: it exits) and returns them
// grouped by stack, the largest groups first.
func goroutineDump(t *testing.T, p *mrproc.Process) string {
	t.Helper()
	p.Signal(t, syscall.SIGQUIT)
	p.Wait(t, 30*time.Second)
	logs := p.Logs()
	i := strings.Index(logs, "goroutine ")
	if i < 0 {
		return "no goroutine dump"
	}
	groups := map[string]int{}
	for _, g := range strings.Split(logs[i:], "\n\n") {
		lines := strings.Split(strings.TrimSpace(g), "\n")
		if len(lines) < 2 || !strings.HasPrefix(lines[0], "goroutine ") {
			continue
		}
		var frames []string
		for _, l := range lines[1:] {
			if !strings.HasPrefix(l, "\t") { // function lines; file:line lines are indented
				frames = append(frames, l[:max(strings.LastIndexByte(l, '('), 0)])
			}
		}
		state := lines[0][strings.IndexByte(lines[0], '['):]
		if j := strings.IndexByte(state, ','); j > 0 {
			state = state[:j] + "]"
		}
		groups[state+" "+strings.Join(frames, " < ")]++
	}
	keys := make([]string, 0, len(groups))
	for k := range groups {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(a, b int) bool { return groups[keys[a]] > groups[keys[b]] })
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, "%5d %s\n", groups[k], k)
	}
	return b.String()
}
