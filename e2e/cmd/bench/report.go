package main

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"
	"strings"
	"time"
)

// metric is one row of the table: how to print a result's figure, and its goal if it has one.
type metric struct {
	name  string
	goal  string
	value func(r result) string // "" when not measured
	// check reports whether the goal applies to r (its N) and whether r meets it.
	check func(r result) (applies, pass bool)
}

const (
	idleCPUGoal      = 0.1 // % of one core: "near zero", no polling
	rss100Goal       = 25  // MiB; none at 1000 drivers: issue 7's "< 64" became peak1000Goal and rssAt1000Goal
	published1000    = time.Second
	reload1000Goal   = 150 * time.Millisecond
	recoveryOverhead = 5 * time.Millisecond
	peak1000Goal     = 80 // MiB, VmHWM: gRPC's server holds three goroutines per connection while kubelet registers 1000 at once
	rssAt1000Goal    = 40 // MiB, a minute after registration
	// A rejection is retried before kubelet's next reconciler pass, a second later: the driver
	// registers again at that pass.
	recoveryDefaultGoal = 1500 * time.Millisecond
)

func mib(kib int64) string { return fmt.Sprintf("%.1f", float64(kib)/1024) }

func secs(d time.Duration) string {
	if d == 0 {
		return ""
	}
	return fmt.Sprintf("%.3f", d.Seconds())
}

func millis(d time.Duration) string {
	if d == 0 {
		return ""
	}
	return fmt.Sprintf("%.1f", float64(d)/float64(time.Millisecond))
}

func per(total float64, n int) string { return fmt.Sprintf("%.1f", total/float64(n)) }

func forN(n int, ok func(result) bool) func(result) (bool, bool) {
	return func(r result) (bool, bool) {
		if r.N != n {
			return false, false
		}
		return true, ok(r)
	}
}

func measuredFP(f func(r result) string) func(r result) string {
	return func(r result) string {
		if r.FP.RSS == 0 {
			return ""
		}
		return f(r)
	}
}

var metrics = []metric{
	{name: "all sockets published (s)", goal: fmt.Sprintf("N=1000: < %v", published1000),
		value: func(r result) string { return secs(r.Published) },
		check: forN(1000, func(r result) bool { return r.Published > 0 && r.Published < published1000 })},
	{name: "first socket published (s)", value: func(r result) string { return secs(r.FirstSocket) }},
	{name: "… CPU meanwhile: multireg / kubelet (bench) / endpoints / rest, % of all CPUs", value: func(r result) string {
		c := r.StartCPU
		if c.total == 0 {
			return ""
		}
		pct := func(t int64) float64 { return float64(t) / float64(c.total) * 100 }
		rest := c.machine - c.multireg - c.bench - c.endpoints
		return fmt.Sprintf("%.0f / %.0f / %.0f / %.0f", pct(c.multireg), pct(c.bench), pct(c.endpoints), pct(max(rest, 0)))
	}},
	{name: "… multireg's CPU time until then (CPU-s)", value: func(r result) string {
		if r.StartCPU.total == 0 {
			return ""
		}
		return fmt.Sprintf("%.2f", float64(r.StartCPU.multireg)/userHZ)
	}},
	{name: "all registered in kubelet (s)¹", value: func(r result) string { return secs(r.Registered) }},
	{name: "RSS total (MiB)", goal: fmt.Sprintf("N=100: < %d", rss100Goal),
		value: measuredFP(func(r result) string { return mib(r.FP.RSS) }),
		check: forN(100, func(r result) bool { return r.FP.RSS > 0 && r.FP.RSS < rss100Goal*1024 })},
	{name: "node condition's agent: RSS (MiB)", value: func(r result) string {
		if r.AgentFP.RSS == 0 {
			return ""
		}
		return mib(r.AgentFP.RSS)
	}},
	{name: "RSS per driver (KiB)", value: measuredFP(func(r result) string { return per(float64(r.FP.RSS), r.N) })},
	{name: "RSS anonymous / file-backed (MiB)", value: measuredFP(func(r result) string { return mib(r.FP.RSSAnon) + " / " + mib(r.FP.RSSFile) })},
	{name: "peak RSS, VmHWM (MiB)", goal: fmt.Sprintf("N=1000: < %d", peak1000Goal),
		value: measuredFP(func(r result) string { return mib(r.FP.HWM) }),
		check: forN(1000, func(r result) bool { return r.FP.HWM > 0 && r.FP.HWM < peak1000Goal*1024 })},
	{name: "RSS a minute after all registered, before any scrape (MiB)", goal: fmt.Sprintf("N=1000: < %d", rssAt1000Goal),
		value: func(r result) string {
			if r.RSSAt == 0 {
				return ""
			}
			if at := r.RSSAtAfter.Round(time.Second); at != time.Minute {
				return fmt.Sprintf("%s (at %v)", mib(r.RSSAt), at) // -rss-at, or a longer idle window
			}
			return mib(r.RSSAt)
		},
		// The goal is a minute's: a reading taken sooner says nothing of it.
		check: func(r result) (bool, bool) {
			if r.N != 1000 || r.RSSAt == 0 || r.RSSAtAfter < time.Minute {
				return false, false
			}
			return true, r.RSSAt < rssAt1000Goal*1024
		}},
	{name: "RSS right after the first /metrics scrape (MiB)", value: func(r result) string {
		if r.RSSAfterScrape == 0 {
			return ""
		}
		return mib(r.RSSAfterScrape)
	}},
	{name: "RSS after two more GCs (MiB)⁵", value: func(r result) string {
		if errors.Is(r.SettledErr, errNoGC) {
			return "no GC ran"
		}
		if r.Settled.RSS == 0 {
			return ""
		}
		return fmt.Sprintf("%s (at %.0f s)", mib(r.Settled.RSS), r.SettledAfter.Seconds())
	}},
	{name: "… its Go heap in use / stacks (MiB)⁵", value: func(r result) string {
		if r.Settled.RSS == 0 {
			return ""
		}
		return fmt.Sprintf("%.1f / %.1f", r.SettledHeap/(1<<20), r.SettledStacks/(1<<20))
	}},
	{name: "PSS total (MiB)", value: measuredFP(func(r result) string { return mib(r.FP.PSS) })},
	{name: "PSS per driver (KiB)", value: measuredFP(func(r result) string { return per(float64(r.FP.PSS), r.N) })},
	{name: "threads", value: measuredFP(func(r result) string { return fmt.Sprint(r.FP.Threads) })},
	{name: "goroutines", value: measuredFP(func(r result) string { return fmt.Sprint(r.Goroutines) })},
	{name: "goroutines per driver", value: measuredFP(func(r result) string { return per(r.Goroutines, r.N) })},
	{name: "open fds", value: measuredFP(func(r result) string { return fmt.Sprint(r.FP.FDs) })},
	{name: "open fds per driver", value: measuredFP(func(r result) string { return per(float64(r.FP.FDs), r.N) })},
	{name: "Go heap in use / stacks (MiB)", value: measuredFP(func(r result) string {
		return fmt.Sprintf("%.1f / %.1f", r.HeapInuse/(1<<20), r.StackInuse/(1<<20))
	})},
	{name: "Go runtime's memory from the OS (MiB)", value: measuredFP(func(r result) string { return fmt.Sprintf("%.1f", r.GoSys/(1<<20)) })},
	{name: "idle CPU (% of one core)²", goal: fmt.Sprintf("≈ 0 (< %.1f)", idleCPUGoal),
		value: func(r result) string {
			if r.IdleWindow == 0 {
				return ""
			}
			return fmt.Sprintf("%.3f", r.IdleCPU)
		},
		check: func(r result) (bool, bool) { return r.IdleWindow > 0, r.IdleCPU < idleCPUGoal }},
	{name: "idle CPU time, schedstat (ms per minute)", value: func(r result) string {
		if r.IdleWindow == 0 {
			return ""
		}
		return fmt.Sprintf("%.2f", float64(r.IdleRunNs)/1e6/r.IdleWindow.Minutes())
	}},
	{name: "idle wake-ups (context switches/s)", value: func(r result) string {
		if r.IdleWindow == 0 {
			return ""
		}
		return fmt.Sprintf("%.1f", r.IdleWakeups)
	}},
	{name: "rest of the machine busy meanwhile (% of all CPUs)", value: func(r result) string {
		if r.IdleWindow == 0 {
			return ""
		}
		return fmt.Sprintf("%.1f", r.SysBusy)
	}},
	{name: "reload: write → new socket (ms)", goal: fmt.Sprintf("N=1000: < %d", reload1000Goal.Milliseconds()),
		value: func(r result) string { return millis(r.ReloadApplied) },
		check: forN(1000, func(r result) bool { return r.ReloadApplied > 0 && r.ReloadApplied < reload1000Goal })},
	{name: "reload: write → \"config reloaded\" logged (ms)³", value: func(r result) string { return millis(r.ReloadLogged) }},
	{name: "`multireg validate` of the file, process included (ms)", value: func(r result) string { return millis(r.Validate) }},
	{name: "reload: write → registered again in kubelet (ms)¹", value: func(r result) string { return millis(r.ReloadRegistered) }},
	{name: "reload: other drivers untouched", goal: "all N-1",
		value: func(r result) string {
			if r.ReloadApplied == 0 {
				return ""
			}
			return fmt.Sprintf("%d/%d", r.Untouched, r.Others)
		},
		check: func(r result) (bool, bool) { return r.ReloadApplied > 0, r.Untouched == r.Others }},
	{name: "recovery overhead, CSI driver: rejection → new socket − 1 s (ms)", goal: fmt.Sprintf("< %d", recoveryOverhead.Milliseconds()),
		value: func(r result) string { return overhead(r.Recovery) },
		check: func(r result) (bool, bool) {
			return r.Recovery.Overhead != 0, r.Recovery.Overhead < recoveryOverhead
		}},
	{name: "… from multireg's log line (ms)³", value: func(r result) string { return fromLog(r.Recovery) }},
	{name: "recovery overhead, device plugin (ms)", goal: fmt.Sprintf("< %d", recoveryOverhead.Milliseconds()),
		value: func(r result) string { return overhead(r.RecoveryDev) },
		check: func(r result) (bool, bool) {
			return r.RecoveryDev.Overhead != 0, r.RecoveryDev.Overhead < recoveryOverhead
		}},
	{name: "… from multireg's log line (ms)³", value: func(r result) string { return fromLog(r.RecoveryDev) }},
	{name: "recovery: new socket → registered in kubelet (ms)¹", value: func(r result) string { return millis(r.Recovery.Reregistered) }},
	{name: "recovery, default backoff (DRA driver): rejection → registered again (ms)¹", goal: fmt.Sprintf("< %d", recoveryDefaultGoal.Milliseconds()),
		value: func(r result) string {
			if r.RecoveryDefault.Total == 0 {
				return ""
			}
			return fmt.Sprintf("%s (retryIn %s)", millis(r.RecoveryDefault.Total), r.RecoveryDefault.RetryIn)
		},
		check: func(r result) (bool, bool) {
			return r.RecoveryDefault.Total != 0, r.RecoveryDefault.Total < recoveryDefaultGoal
		}},
	{name: "recovery in the start-up burst, default backoff (CSI driver): rejection → registered again (ms)¹", goal: fmt.Sprintf("< %d", recoveryDefaultGoal.Milliseconds()),
		value: func(r result) string {
			if r.StartRecovery == 0 {
				return ""
			}
			return fmt.Sprintf("%s (retryIn %s)", millis(r.StartRecovery), r.StartRetryIn)
		},
		check: func(r result) (bool, bool) { return r.StartRecovery != 0, r.StartRecovery < recoveryDefaultGoal }},
	{name: "liveness check under 100 clients at once: p50 / p99 (ms)", value: func(r result) string {
		if r.Health.Checks == 0 {
			return ""
		}
		return fmt.Sprintf("%s / %s", millis(r.Health.P50), millis(r.Health.P99))
	}},
	{name: "… checks in 5 s, failed", value: func(r result) string {
		if r.Health.Checks == 0 {
			return ""
		}
		return fmt.Sprintf("%d, %d", r.Health.Checks, r.Health.Failed)
	}},
	{name: "multireg WARN/ERROR log lines⁴", value: func(r result) string {
		n := 0
		for _, c := range r.Warnings {
			n += c
		}
		return fmt.Sprint(n)
	}},
}

func overhead(r recoveryResult) string {
	if r.Overhead == 0 {
		return ""
	}
	return fmt.Sprintf("%.2f", float64(r.Overhead)/float64(time.Millisecond))
}

func fromLog(r recoveryResult) string {
	if r.RetryIn == "" {
		return ""
	}
	return fmt.Sprintf("%.0f (retryIn %s)", float64(r.FromLog)/float64(time.Millisecond), r.RetryIn)
}

// renderReport renders the figures as markdown (also readable as plain text).
func renderReport(m machine, o options, results []result) string {
	var b strings.Builder
	fmt.Fprintf(&b, "### Measured on this machine\n\n")
	fmt.Fprintf(&b, "- When: %s, by `go run ./cmd/bench %s`\n", m.Date, strings.Join(os.Args[1:], " "))
	fmt.Fprintf(&b, "- multireg: `%s, from the tree at %s\n", m.Multireg, m.Commit)
	fmt.Fprintf(&b, "- Machine: %d CPUs (%s), %d MiB memory, Linux %s, %s; load average at the start %s\n",
		m.CPUs, m.CPUModel, m.MemTotalMiB, m.Kernel, m.GoVersion, m.LoadAvg)
	fmt.Fprintf(&b, "- Kubelet plugin manager %s in the benchmark process; endpoints in their own process; idle window %v; directories in %s (%s)\n",
		m.Kubelet, o.idle, m.TmpDir, m.TmpFS)
	if o.api != nil {
		fmt.Fprintf(&b, "- The node condition on (`--node-condition %s`), against etcd and kube-apiserver on this machine; kubelet records the CSI drivers in the node's CSINode\n", conditionType)
	} else {
		fmt.Fprintf(&b, "- The node condition off (no `--node-condition`: no Kubernetes client)\n")
	}
	b.WriteString("\n")

	header := []string{"figure"}
	for _, r := range results {
		header = append(header, fmt.Sprintf("N=%d", r.N))
	}
	header = append(header, "goal")
	rows := [][]string{header}
	for _, mt := range metrics {
		row := []string{mt.name}
		for _, r := range results {
			v := mt.value(r)
			if v == "" {
				row = append(row, "—")
				continue
			}
			if mt.check != nil {
				if applies, pass := mt.check(r); applies {
					if pass {
						v += " PASS"
					} else {
						v += " MISS"
					}
				}
			}
			row = append(row, v)
		}
		row = append(row, mt.goal)
		rows = append(rows, row)
	}
	writeTable(&b, rows)
	b.WriteString("\n¹ includes kubelet's reconciler, which passes once a second.  \n")
	b.WriteString("² utime+stime from /proc/PID/stat over the window (1/100 s ticks), with every driver registered and nothing changing.  \n")
	b.WriteString("³ multireg's log time stamps have millisecond precision.  \n")
	b.WriteString("⁴ each recovery's rejection logs one (WARN registration failed); all of them, by N:")
	for _, r := range results {
		keys := slices.Sorted(maps.Keys(r.Warnings))
		var parts []string
		for _, k := range keys {
			parts = append(parts, fmt.Sprintf("%d× %s", r.Warnings[k], k))
		}
		if len(parts) > 0 {
			fmt.Fprintf(&b, " N=%d: %s;", r.N, strings.Join(parts, ", "))
		}
	}
	b.WriteString("\n")
	b.WriteString("⁵ when idle, the Go runtime forces a garbage collection 2 minutes after the last one (never, if none has run yet); after two more, buffers pooled during the start-up are freed and the scavenger has returned them (-gc-wait; counted from GODEBUG=gctrace=1). Taken after the /metrics scrape above.\n")
	for _, r := range results {
		if r.SettledGC != "" {
			fmt.Fprintf(&b, "\nN=%d, multireg's last GC before the settled footprint: `%s`\n", r.N, r.SettledGC)
		}
	}
	for _, r := range results {
		if r.SettledErr != nil && !errors.Is(r.SettledErr, errNoGC) {
			fmt.Fprintf(&b, "\nN=%d: no settled footprint: %v\n", r.N, r.SettledErr)
		}
		if r.Err != nil {
			fmt.Fprintf(&b, "\n**N=%d failed:** %s\n", r.N, strings.ReplaceAll(r.Err.Error(), "\n", "\n    "))
		}
	}

	b.WriteString("\n### Beside N node-driver-registrar sidecars\n\n")
	b.WriteString("Sidecar figures from [the sidecar baseline](#the-sidecar-baseline), below: node-driver-registrar ")
	b.WriteString("at 3482d444 for 1, 10 and 50 sidecars, v2.17.0 for 100 and 1000 (measured beside multireg v0.1.0: ")
	b.WriteString("RSS after registration, all sockets published); ")
	b.WriteString("*extrapolated* ones are linear in the per-driver figures of 1 to 50: RSS 19,450 KiB each; PSS 19,460 KiB ")
	b.WriteString("plus 3,323 KiB for each further sidecar (the slope between 10 and 50); 6.7–7 threads each; ")
	b.WriteString("3.7–5.1 ms of socket start-up each (50 sidecars: 0.186–0.254 s).\n\n")
	cmp := [][]string{{"N", "multireg RSS (MiB)", "sidecars RSS (MiB)", "multireg PSS (MiB)", "sidecars PSS (MiB)",
		"multireg threads", "sidecars threads", "multireg: all sockets published (s)", "sidecars: all sockets ready (s)"}}
	for _, r := range results {
		s := sidecars(r.N)
		row := []string{fmt.Sprint(r.N), "—", s.rss, "—", s.pss, "—", s.threads, "—", s.ready}
		if r.FP.RSS > 0 {
			row[1], row[3], row[5] = mib(r.FP.RSS), mib(r.FP.PSS), fmt.Sprint(r.FP.Threads)
		}
		if r.Published > 0 {
			row[7] = secs(r.Published)
		}
		cmp = append(cmp, row)
	}
	writeTable(&b, cmp)
	return b.String()
}

type sidecarFigures struct{ rss, pss, threads, ready string }

// sidecars returns the incumbent's figures for n sidecars (BENCHMARKS.md, "The sidecar
// baseline"): measured for 1, 10 and 50 (node-driver-registrar at 3482d444) and for 100 and
// 1000 (v2.17.0, beside multireg v0.1.0), else extrapolated linearly from the per-driver
// figures of 1 to 50.
func sidecars(n int) sidecarFigures {
	switch n {
	case 1:
		return sidecarFigures{"19.0", "19.0", "7", "0.016"}
	case 10:
		return sidecarFigures{"189.7–190.3", "≈ 48.4", "69–70", "0.048–0.057"}
	case 50:
		return sidecarFigures{"950.6–951.4", "≈ 178.2", "335–347", "0.186–0.254"}
	case 100:
		return sidecarFigures{"1860 (v2.17.0)", "336 (v2.17.0)", "680 (v2.17.0)", "0.53–0.73 (v2.17.0)"}
	case 1000:
		return sidecarFigures{"18657 (v2.17.0)", "3224 (v2.17.0)", "6977 (v2.17.0)", "12.7 (v2.17.0)"}
	}
	f := float64(n)
	return sidecarFigures{
		rss:     fmt.Sprintf("≈ %.0f *(extrapolated)*", 19450*f/1024),
		pss:     fmt.Sprintf("≈ %.0f *(extrapolated)*", (19460+3323*(f-1))/1024),
		threads: fmt.Sprintf("≈ %.0f–%.0f *(extrapolated)*", 6.7*f, 7*f),
		ready:   fmt.Sprintf("≈ %.2f–%.2f *(extrapolated)*", 0.0037*f, 0.0051*f),
	}
}

// writeTable writes a markdown table with padded columns.
func writeTable(b *strings.Builder, rows [][]string) {
	width := make([]int, len(rows[0]))
	for _, row := range rows {
		for i, c := range row {
			width[i] = max(width[i], len([]rune(c)))
		}
	}
	line := func(row []string) {
		b.WriteString("|")
		for i, c := range row {
			pad := strings.Repeat(" ", width[i]-len([]rune(c)))
			if i == 0 {
				fmt.Fprintf(b, " %s%s |", c, pad)
			} else {
				fmt.Fprintf(b, " %s%s |", pad, c)
			}
		}
		b.WriteString("\n")
	}
	line(rows[0])
	b.WriteString("|")
	for i, w := range width {
		if i == 0 {
			b.WriteString(strings.Repeat("-", w+2) + "|")
		} else {
			b.WriteString(strings.Repeat("-", w+1) + ":|")
		}
	}
	b.WriteString("\n")
	for _, row := range rows[1:] {
		line(row)
	}
}

const (
	beginMarker = "<!-- bench:begin -->"
	endMarker   = "<!-- bench:end -->"
)

// writeReport puts the report between the markers of path, keeping the rest of the file; a
// missing file is created with just the markers and the report.
func writeReport(path, report string) error {
	section := beginMarker + "\n" + report + endMarker
	old, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return os.WriteFile(path, []byte("# Benchmarks\n\n"+section+"\n"), 0o644)
	}
	if err != nil {
		return err
	}
	// Markers on lines of their own: the file may quote them in its text.
	s := string(old)
	i, j := strings.Index(s, "\n"+beginMarker+"\n"), strings.Index(s, "\n"+endMarker+"\n")
	if i < 0 || j < i {
		return fmt.Errorf("%s has no %s … %s section, each marker on a line of its own: not overwriting it", path, beginMarker, endMarker)
	}
	return os.WriteFile(path, []byte(s[:i+1]+section+s[j+1+len(endMarker):]), 0o644)
}
