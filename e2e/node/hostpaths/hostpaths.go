// Package hostpaths handles what a test cluster leaves on the host outside its own
// directory: mounts below it, and the directories that kubelet, containerd, runc and the CNI
// plugins create at fixed paths.
package hostpaths

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"golang.org/x/sys/unix"
)

// Fixed are the directories outside a cluster's own that kubelet, containerd and the CNI
// plugins create at fixed paths (kubelet's device-plugin directory and legacy container-log
// links, the pods' network namespaces, the CNI result cache, containerd's shim sockets,
// FIFOs and opt directory, runc's state for ctr), parents first.
var Fixed = []string{
	"/var/lib/kubelet", "/var/lib/kubelet/device-plugins", "/var/log/containers",
	"/run/netns", "/var/lib/cni", "/var/lib/cni/results",
	"/run/containerd", "/run/containerd/s", "/run/containerd/fifo", "/run/containerd/runc", "/run/containerd/runc/k8s.io",
	"/opt/containerd", "/opt/containerd/bin", "/opt/containerd/lib",
}

// RemoveEmptyDirs removes dirs, last first, each only if it is empty (a directory that holds
// something it did not expect is not its to remove: that is an error naming it). Gone
// already is fine.
func RemoveEmptyDirs(dirs []string) error {
	var errs []error
	for i := len(dirs) - 1; i >= 0; i-- {
		if err := os.Remove(dirs[i]); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, fmt.Errorf("leaving %s: %w", dirs[i], err))
		}
	}
	return errors.Join(errs...)
}

// Absent returns the directories outside a cluster's own that kubelet, containerd, runc and
// the CNI plugins create at fixed paths (Fixed) and the k8s.io cgroup runc creates in every
// cgroup hierarchy, which do not exist now: those that appear later are the cluster's (or a
// test's containerd's), for RemoveEmptyDirs.
func Absent() []string {
	candidates := append([]string(nil), Fixed...)
	if hiers, err := os.ReadDir("/sys/fs/cgroup"); err == nil {
		candidates = append(candidates, "/sys/fs/cgroup/k8s.io") // cgroup v2
		for _, h := range hiers {
			if h.IsDir() {
				candidates = append(candidates, filepath.Join("/sys/fs/cgroup", h.Name(), "k8s.io"))
			}
		}
	}
	var absent []string
	for _, d := range candidates {
		if _, err := os.Lstat(d); errors.Is(err, fs.ErrNotExist) {
			absent = append(absent, d)
		}
	}
	return absent
}

// UnmountBelow unmounts every mount point at or below dir, deepest first.
func UnmountBelow(dir string) error {
	dir = filepath.Clean(dir)
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return err
	}
	var points []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		p := unescapeMount(f[4])
		if p == dir || strings.HasPrefix(p, dir+"/") {
			points = append(points, p)
		}
	}
	// Deepest first; a path mounted several times appears as often as it is mounted.
	sort.SliceStable(points, func(i, j int) bool {
		return strings.Count(points[i], "/") > strings.Count(points[j], "/")
	})
	var errs []error
	for _, p := range points {
		errs = append(errs, unmount(p))
	}
	return errors.Join(errs...)
}

// unmount unmounts p, falling back to a lazy unmount (bounded: it always returns at once)
// when something still holds it.
func unmount(p string) error {
	err := unix.Unmount(p, 0)
	if err == nil || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT) {
		return nil // EINVAL: not a mount point (any more)
	}
	if err2 := unix.Unmount(p, unix.MNT_DETACH); err2 != nil && !errors.Is(err2, unix.EINVAL) {
		return fmt.Errorf("unmount %s: %v; lazily: %w", p, err, err2)
	}
	return nil
}

// unescapeMount decodes mountinfo's octal escapes (\040 for a space, …).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			var c int
			if _, err := fmt.Sscanf(s[i+1:i+4], "%o", &c); err == nil {
				b.WriteByte(byte(c))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
