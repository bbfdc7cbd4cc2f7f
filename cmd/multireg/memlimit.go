package main

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"runtime/debug"
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

// cgroupMemoryMax reads the memory limit of the process's cgroup: 0 when there is none. root
// is the cgroup file system's mount point (/sys/fs/cgroup) and procCgroup the content of
// /proc/self/cgroup. In a container the process's cgroup is the namespace's root, which is
// where the cgroup file system is mounted; on a host it is the path /proc/self/cgroup gives.
func cgroupMemoryMax(root string, procCgroup []byte) (int64, string, error) {
	var candidates []string
	sc := bufio.NewScanner(bytes.NewReader(procCgroup))
	for sc.Scan() {
		// hierarchy-ID:controller-list:cgroup-path
		parts := strings.SplitN(sc.Text(), ":", 3)
		if len(parts) != 3 {
			continue
		}
		switch {
		case parts[0] == "0" && parts[1] == "": // cgroup v2
			candidates = append(candidates, filepath.Join(root, parts[2], "memory.max"), filepath.Join(root, "memory.max"))
		case hasController(parts[1], "memory"): // cgroup v1
			candidates = append(candidates, filepath.Join(root, "memory", parts[2], "memory.limit_in_bytes"), filepath.Join(root, "memory", "memory.limit_in_bytes"))
		}
	}
	for _, file := range candidates {
		b, err := os.ReadFile(file)
		if os.IsNotExist(err) {
			continue
		}
		if err != nil {
			return 0, file, fmt.Errorf("read the memory limit: %w", err)
		}
		s := strings.TrimSpace(string(b))
		if s == "max" {
			return 0, file, nil
		}
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return 0, file, fmt.Errorf("read the memory limit: %s: %q is not a number of bytes", file, s)
		}
		if n >= unlimitedV1 {
			return 0, file, nil
		}
		return n, file, nil
	}
	return 0, "", nil
}

func hasController(list, name string) bool {
	for c := range strings.SplitSeq(list, ",") {
		if c == name {
			return true
		}
	}
	return false
}
