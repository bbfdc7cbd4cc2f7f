//go:build linux

package main

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
)

// memLimitShare is the part of the container's memory limit given to the Go runtime as its
// soft limit: the rest is for what the runtime does not count (the binary's pages, the
// kernel's socket buffers) and a margin before the kernel's OOM killer.
const memLimitShare = 0.9

// setMemoryLimit gives the Go runtime a soft memory limit of memLimitShare of the memory limit
// of the process's cgroup (cgroup v2's memory.max, or v1's memory.limit_in_bytes), so that the
// garbage collector works harder as the process nears it instead of letting the heap grow to
// twice what is live and the kernel kill the pod that holds every registration of the node.
// GOMEMLIMIT, when set, is the runtime's, and wins. It returns what it did, for the log: the
// limit set (0 when none) and where it came from.
func setMemoryLimit(root string, procCgroup []byte) (limit int64, from string, err error) {
	if v := os.Getenv("GOMEMLIMIT"); v != "" {
		return debug.SetMemoryLimit(-1), "GOMEMLIMIT=" + v, nil
	}
	max, file, err := cgroupMemoryMax(root, procCgroup)
	if err != nil || max <= 0 {
		return 0, file, err
	}
	limit = int64(float64(max) * memLimitShare)
	debug.SetMemoryLimit(limit)
	return limit, fmt.Sprintf("%.0f%% of %d bytes in %s", memLimitShare*100, max, file), nil
}

// unlimitedV1 is above any memory.limit_in_bytes a cgroup v1 limit sets (unlimited reads as
// 2^63 rounded down to the page size).
const unlimitedV1 = 1 << 62

// cgroupMemoryMax reads the memory limit of the process's cgroup: the lowest of its own and its
// ancestors' limits, 0 when there is none. root is the cgroup file system's mount point
// (/sys/fs/cgroup) and procCgroup the content of /proc/self/cgroup. In a container the
// process's cgroup is the namespace's root, where the cgroup file system is mounted; on a host
// it is the path /proc/self/cgroup gives, under the limits of its parents (a slice).
func cgroupMemoryMax(root string, procCgroup []byte) (int64, string, error) {
	v2, isV2 := "", false
	sc := bufio.NewScanner(bytes.NewReader(procCgroup))
	for sc.Scan() {
		// hierarchy-ID:controller-list:cgroup-path
		parts := strings.SplitN(sc.Text(), ":", 3)
		switch {
		case len(parts) != 3:
		case slices.Contains(strings.Split(parts[1], ","), "memory"): // cgroup v1 (also beside a v2 hierarchy)
			return cgroupV1Limit(filepath.Join(root, "memory"), parts[2])
		case parts[0] == "0" && parts[1] == "":
			v2, isV2 = parts[2], true
		}
	}
	if !isV2 {
		return 0, "", nil
	}
	// From the process's cgroup up to the root, the lowest memory.max.
	var limit int64
	var from string
	for dir := cgroupDir(root, v2); ; dir = filepath.Dir(dir) {
		n, file, err := readLimit(filepath.Join(dir, "memory.max"))
		if err != nil {
			return 0, file, err
		}
		if n > 0 && (limit == 0 || n < limit) {
			limit, from = n, file
		}
		if dir == filepath.Clean(root) {
			return limit, from, nil
		}
	}
}

// cgroupV1Limit reads a v1 memory cgroup's limit, its ancestors' included
// (hierarchical_memory_limit in memory.stat), or its own memory.limit_in_bytes.
func cgroupV1Limit(mount, path string) (int64, string, error) {
	dir := cgroupDir(mount, path)
	file := filepath.Join(dir, "memory.stat")
	if b, err := os.ReadFile(file); err == nil {
		for line := range strings.Lines(string(b)) {
			if v, ok := strings.CutPrefix(line, "hierarchical_memory_limit "); ok {
				return parseLimit(file, v)
			}
		}
	}
	return readLimit(filepath.Join(dir, "memory.limit_in_bytes"))
}

// cgroupDir is the directory of the cgroup at path under the mount point root, or root when
// it is not there: in a container, the namespace's root is what is mounted.
func cgroupDir(root, path string) string {
	dir := filepath.Join(root, path)
	if fi, err := os.Stat(dir); err != nil || !fi.IsDir() || !strings.HasPrefix(dir, filepath.Clean(root)) {
		return filepath.Clean(root)
	}
	return dir
}

// readLimit reads a limit file: 0 when it is missing or says there is no limit.
func readLimit(file string) (int64, string, error) {
	b, err := os.ReadFile(file)
	if os.IsNotExist(err) {
		return 0, "", nil
	}
	if err != nil {
		return 0, file, fmt.Errorf("read the memory limit: %w", err)
	}
	return parseLimit(file, string(b))
}

func parseLimit(file, v string) (int64, string, error) {
	v = strings.TrimSpace(v)
	if v == "max" {
		return 0, file, nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return 0, file, fmt.Errorf("read the memory limit: %s: %q is not a number of bytes", file, v)
	}
	if n >= unlimitedV1 {
		return 0, file, nil
	}
	return n, file, nil
}
