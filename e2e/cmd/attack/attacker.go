package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"multireg.dev/multireg/e2e/kubelet"
)

// watch samples multireg's RSS every 100 ms and, every 3 s, removes one driver's socket and
// times how long kubelet takes to register the socket multireg publishes again. It returns
// the peak RSS (KiB), the re-registration times, and whether multireg was alive at the end.
func watch(ctx context.Context, k *kubelet.Kubelet, pid int, reg string, names []string) (int, string, bool) {
	peak := 0
	var lat []string
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	next := time.Now().Add(3 * time.Second)
	victim, removed := 0, time.Time{}
	var before int
	for {
		select {
		case <-ctx.Done():
			if !removed.IsZero() {
				lat = append(lat, "not registered again before the attack ended")
			}
			return peak, strings.Join(lat, ", "), syscall.Kill(pid, 0) == nil
		case <-tick.C:
		}
		r := rss(pid)
		if r == 0 {
			return peak, strings.Join(lat, ", "), false
		}
		peak = max(peak, r)
		name := names[victim%len(names)]
		switch {
		case removed.IsZero() && time.Now().After(next):
			socks, _ := filepath.Glob(filepath.Join(reg, "*.sock"))
			before = len(k.EventsFor(name))
			for _, s := range socks {
				if strings.Contains(s, strings.ReplaceAll(name, "/", "_")) {
					if os.Remove(s) == nil {
						removed = time.Now()
					}
				}
			}
		case !removed.IsZero() && k.Registered(name) && len(k.EventsFor(name)) > before+1:
			lat = append(lat, time.Since(removed).Round(10*time.Millisecond).String())
			removed, victim, next = time.Time{}, victim+1, time.Now().Add(3*time.Second)
		}
	}
}

// rss returns pid's VmRSS in KiB; 0 when it is gone.
func rss(pid int) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
			n, _ := strconv.Atoi(f[1])
			return n
		}
	}
	return 0
}

// cgroupPeak returns the cgroup's memory.peak, or "-".
func cgroupPeak(cg string) string {
	if cg == "" {
		return "-"
	}
	peak, events := "memory.peak", "memory.events" // cgroup v2
	if _, err := os.Stat(filepath.Join(cg, peak)); err != nil {
		peak, events = "memory.max_usage_in_bytes", "memory.oom_control" // v1
	}
	b, err := os.ReadFile(filepath.Join(cg, peak))
	if err != nil {
		return "-"
	}
	n, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	ev, _ := os.ReadFile(filepath.Join(cg, events))
	return fmt.Sprintf("%d KiB (%s: %s)", n/1024, events, strings.Join(strings.Fields(string(ev)), " "))
}
