//go:build linux

package main

import (
	"math"
	"os"
	"path/filepath"
	"runtime/debug"
	"strings"
	"testing"
)

// cgroupFS writes files (path → content) under a temporary cgroup root.
func cgroupFS(t *testing.T, files map[string]string) string {
	t.Helper()
	root := t.TempDir()
	for p, c := range files {
		p = filepath.Join(root, p)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

func TestCgroupMemoryMax(t *testing.T) {
	for _, tc := range []struct {
		name       string
		files      map[string]string
		procCgroup string
		want       int64
		wantErr    string
	}{
		{"v2 in a container: the namespace's root", map[string]string{"memory.max": "134217728\n"}, "0::/\n", 134217728, ""},
		{"v2 on a host: the process's own cgroup", map[string]string{"memory.max": "max\n", "system.slice/multireg.service/memory.max": "67108864\n"}, "0::/system.slice/multireg.service\n", 67108864, ""},
		{"v2 without a limit", map[string]string{"memory.max": "max\n"}, "0::/\n", 0, ""},
		{"v1", map[string]string{"memory/kubepods/pod1/c1/memory.limit_in_bytes": "134217728\n"}, "5:cpu,cpuacct:/kubepods/pod1/c1\n4:memory:/kubepods/pod1/c1\n", 134217728, ""},
		{"v1 in a container: the hierarchy's root", map[string]string{"memory/memory.limit_in_bytes": "134217728\n"}, "4:memory:/kubepods/pod1/c1\n", 134217728, ""},
		{"v1 without a limit", map[string]string{"memory/memory.limit_in_bytes": "9223372036854771712\n"}, "4:memory:/\n", 0, ""},
		{"hybrid: v1's memory controller, no v2 file", map[string]string{"memory/x/memory.limit_in_bytes": "268435456"}, "4:memory:/x\n0::/\n", 268435456, ""},
		{"v2: a parent's lower limit", map[string]string{"memory.max": "max\n", "s.slice/memory.max": "50000000\n", "s.slice/m.service/memory.max": "67108864\n"}, "0::/s.slice/m.service\n", 50000000, ""},
		{"v1: the hierarchy's limit", map[string]string{"memory/a/memory.limit_in_bytes": "9223372036854771712\n", "memory/a/memory.stat": "cache 0\nhierarchical_memory_limit 33554432\n"}, "4:memory:/a\n", 33554432, ""},
		{"no cgroup file system", nil, "0::/\n", 0, ""},
		{"not a number", map[string]string{"memory.max": "lots\n"}, "0::/\n", 0, `memory.max: "lots" is not a number of bytes`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, _, err := cgroupMemoryMax(cgroupFS(t, tc.files), []byte(tc.procCgroup))
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err %v, want one saying %q", err, tc.wantErr)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Errorf("got %d, %v; want %d", got, err, tc.want)
			}
		})
	}
}

// TestSetMemoryLimit: the runtime gets 90% of the cgroup's limit, and GOMEMLIMIT, when set,
// is left as it is.
func TestSetMemoryLimit(t *testing.T) {
	t.Cleanup(func() { debug.SetMemoryLimit(math.MaxInt64) })
	root := cgroupFS(t, map[string]string{"memory.max": "100000000\n"})
	t.Setenv("GOMEMLIMIT", "")
	limit, from, err := setMemoryLimit(root, []byte("0::/\n"))
	if err != nil || limit != 90000000 || debug.SetMemoryLimit(-1) != 90000000 {
		t.Fatalf("limit %d (runtime: %d) from %q, %v; want 90000000", limit, debug.SetMemoryLimit(-1), from, err)
	}
	if !strings.Contains(from, "memory.max") {
		t.Errorf("from %q does not name the file", from)
	}

	debug.SetMemoryLimit(math.MaxInt64) // as the runtime would have set GOMEMLIMIT=off
	t.Setenv("GOMEMLIMIT", "off")
	if limit, from, _ := setMemoryLimit(root, []byte("0::/\n")); limit != math.MaxInt64 || from != "GOMEMLIMIT=off" {
		t.Errorf("with GOMEMLIMIT=off: limit %d from %q, want the runtime's own", limit, from)
	}
}
