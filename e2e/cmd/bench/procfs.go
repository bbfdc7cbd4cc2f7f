package main

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// userHZ is the unit of utime and stime in /proc/PID/stat: USER_HZ, 100 on every Linux
// architecture Go supports (sysconf(_SC_CLK_TCK)).
const userHZ = 100

// footprint is what /proc says about a process at one moment.
type footprint struct {
	RSS, HWM, RSSAnon, RSSFile int64 // KiB, /proc/PID/status
	PSS, PSSAnon, PSSFile      int64 // KiB, /proc/PID/smaps_rollup
	Threads                    int
	FDs                        int
	CtxSwitches                int64 // voluntary and involuntary, summed over threads
	CPUTicks                   int64 // utime+stime, in 1/userHZ s
}

func readFootprint(pid int) (footprint, error) {
	var fp footprint
	st, err := readKV(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return fp, err
	}
	fp.RSS, fp.HWM = st["VmRSS"], st["VmHWM"]
	fp.RSSAnon, fp.RSSFile = st["RssAnon"], st["RssFile"]
	fp.Threads = int(st["Threads"])
	ro, err := readKV(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
	if err != nil {
		return fp, err
	}
	fp.PSS, fp.PSSAnon, fp.PSSFile = ro["Pss"], ro["Pss_Anon"], ro["Pss_File"]
	fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		return fp, err
	}
	fp.FDs = len(fds)
	if fp.CPUTicks, err = cpuTicks(pid); err != nil {
		return fp, err
	}
	fp.CtxSwitches, err = ctxSwitches(pid)
	return fp, err
}

// readKV reads a "Key:   value [kB]" file into a map of the first number of each line.
func readKV(path string) (map[string]int64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	m := map[string]int64{}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		f := strings.Fields(v)
		if len(f) == 0 {
			continue
		}
		if n, err := strconv.ParseInt(f[0], 10, 64); err == nil {
			m[k] = n
		}
	}
	return m, nil
}

// cpuTicks returns utime+stime of a process (all its threads, living and exited).
func cpuTicks(pid int) (int64, error) {
	path := "/proc/self/stat"
	if pid > 0 {
		path = fmt.Sprintf("/proc/%d/stat", pid)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 || i+2 > len(s) {
		return 0, fmt.Errorf("%s: unexpected format", path)
	}
	// After "pid (comm) ": field 3 (state) is f[0]; utime (14) is f[11], stime (15) f[12].
	f := strings.Fields(s[i+2:])
	if len(f) < 13 {
		return 0, fmt.Errorf("%s: too few fields", path)
	}
	ut, err1 := strconv.ParseInt(f[11], 10, 64)
	stime, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("%s: bad utime/stime", path)
	}
	return ut + stime, nil
}

// ctxSwitches sums the context switches of a process's threads: each is one wake-up (or
// preemption), so their rate while idle shows any polling.
func ctxSwitches(pid int) (int64, error) {
	tasks, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/status", pid))
	if err != nil {
		return 0, err
	}
	var n int64
	for _, t := range tasks {
		kv, err := readKV(t)
		if err != nil {
			continue // the thread exited
		}
		n += kv["voluntary_ctxt_switches"] + kv["nonvoluntary_ctxt_switches"]
	}
	return n, nil
}

// runTime sums the time a process's threads spent on a CPU, in nanoseconds, from
// /proc/PID/task/*/schedstat: finer than the ticks of utime and stime, but a thread that exits
// takes its share with it (Go's threads rarely exit).
func runTime(pid int) (int64, error) {
	tasks, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/schedstat", pid))
	if err != nil {
		return 0, err
	}
	var ns int64
	for _, t := range tasks {
		b, err := os.ReadFile(t)
		if err != nil {
			continue // the thread exited
		}
		f := strings.Fields(string(b))
		if len(f) == 0 {
			continue
		}
		v, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			return 0, fmt.Errorf("%s: %q", t, b)
		}
		ns += v
	}
	return ns, nil
}

// systemCPU returns the busy and total jiffies of the whole machine, from /proc/stat.
func systemCPU() (busy, total int64, err error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0, err
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 8 || f[0] != "cpu" {
		return 0, 0, fmt.Errorf("/proc/stat: unexpected first line %q", line)
	}
	var v [10]int64
	for i := 1; i < len(f) && i <= 10; i++ {
		v[i-1], _ = strconv.ParseInt(f[i], 10, 64)
	}
	// user nice system idle iowait irq softirq steal (guest time is inside user).
	for i := range 8 {
		total += v[i]
	}
	return total - v[3] - v[4], total, nil
}
