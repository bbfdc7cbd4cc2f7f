package cluster

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// stateFile, in the cluster's directory, records everything Cleanup must undo: the PIDs it
// started, the sysctls kubelet changes (with their values before), the bridge, and the files
// outside the directory that kubelet writes whatever its --root-dir. It is written before each
// change, so that `go run ./cmd/cleanup DIR` can undo a run that died without its teardown.
const stateFile = "state.json"

type pidRecord struct {
	PID int    `json:"pid"`
	Exe string `json:"exe"`
}

type state struct {
	PIDs map[string]pidRecord `json:"pids"`
	// Sysctls maps a /proc/sys path to its value before the cluster started.
	Sysctls map[string]string `json:"sysctls"`
	Bridge  string            `json:"bridge,omitempty"`
	// ContainerdAddress is the private containerd's socket, for removing its tasks.
	ContainerdAddress string `json:"containerdAddress,omitempty"`
	// NetnsBefore lists /run/netns before the cluster started: namespaces created later
	// (by the CNI plugins for pods) are the cluster's.
	NetnsBefore []string `json:"netnsBefore"`
	// HostFiles are files outside the directory that kubelet creates at fixed paths
	// (/var/lib/kubelet/device-plugins/…); HostDirs the directories created for them, deepest
	// last. Only these are removed.
	HostFiles []string `json:"hostFiles"`
	HostDirs  []string `json:"hostDirs"`
}

type stateStore struct {
	mu   sync.Mutex
	path string
	s    state
}

func newStateStore(dir string) *stateStore {
	return &stateStore{path: filepath.Join(dir, stateFile), s: state{PIDs: map[string]pidRecord{}, Sysctls: map[string]string{}}}
}

func (st *stateStore) update(f func(*state)) error {
	st.mu.Lock()
	defer st.mu.Unlock()
	f(&st.s)
	b, err := json.MarshalIndent(st.s, "", "  ")
	if err != nil {
		return err
	}
	tmp := st.path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, st.path)
}

func (st *stateStore) get() state {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.s
}

// The sysctls kubelet's container manager sets at start (unless protectKernelDefaults).
var kubeletSysctls = []string{"vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops"}

func readSysctls() (map[string]string, error) {
	m := map[string]string{}
	for _, k := range kubeletSysctls {
		b, err := os.ReadFile("/proc/sys/" + k)
		if err != nil {
			return nil, err
		}
		m[k] = strings.TrimSpace(string(b))
	}
	return m, nil
}

func listNetns() []string {
	ents, _ := os.ReadDir("/run/netns")
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	return names
}

// Cleanup undoes a cluster from its directory's state file: it stops the recorded processes
// that still run (checking each PID still runs the same program), removes the private
// containerd's leftover tasks, unmounts everything below dir and the pods' network
// namespaces, deletes the bridge, restores the sysctls and removes the host files kubelet
// wrote. It is what Stop runs after stopping the components in order, and what
// cmd/cleanup runs after a test binary that died. It reports every step that failed.
func Cleanup(dir string) error {
	b, err := os.ReadFile(filepath.Join(dir, stateFile))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var s state
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("%s: %w", filepath.Join(dir, stateFile), err)
	}
	var errs []error
	// Clients first, servers last: what talks to the API server and containerd, then them.
	for _, name := range []string{"kube-scheduler", "kube-controller-manager", "kubelet"} {
		if rec, ok := s.PIDs[name]; ok {
			errs = append(errs, stopPID(name, rec, 10*time.Second))
		}
	}
	if s.ContainerdAddress != "" {
		if rec, ok := s.PIDs["containerd"]; ok && pidIs(rec) {
			errs = append(errs, removeTasks(s.ContainerdAddress))
		}
	}
	for _, name := range []string{"kube-apiserver", "containerd", "etcd"} {
		if rec, ok := s.PIDs[name]; ok {
			errs = append(errs, stopPID(name, rec, 10*time.Second))
		}
	}
	if s.ContainerdAddress != "" {
		errs = append(errs, killShims(s.ContainerdAddress))
	}
	before := map[string]bool{}
	for _, n := range s.NetnsBefore {
		before[n] = true
	}
	for _, n := range listNetns() {
		if !before[n] && strings.HasPrefix(n, "cni-") {
			p := filepath.Join("/run/netns", n)
			errs = append(errs, unmount(p))
			if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
				errs = append(errs, err)
			}
		}
	}
	errs = append(errs, UnmountBelow(dir))
	if s.Bridge != "" {
		if _, err := os.Stat("/sys/class/net/" + s.Bridge); err == nil {
			_, err := runFor(10*time.Second, "ip", "link", "delete", s.Bridge)
			errs = append(errs, err)
		}
	}
	for k, v := range s.Sysctls {
		errs = append(errs, os.WriteFile("/proc/sys/"+k, []byte(v), 0o644))
	}
	for _, f := range s.HostFiles {
		if err := os.Remove(f); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	errs = append(errs, RemoveEmptyDirs(s.HostDirs))
	return errors.Join(errs...)
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

// AbsentHostDirs returns the directories outside a cluster's own that kubelet, containerd,
// runc and the CNI plugins create at fixed paths (see hostDirs) and the k8s.io cgroup runc
// creates in every cgroup hierarchy, which do not exist now: those that appear later are
// the cluster's (or a test's containerd's), for RemoveEmptyDirs.
func AbsentHostDirs() []string {
	candidates := append([]string(nil), hostDirs...)
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

// removeTasks kills and deletes every task and container of the private containerd's
// Kubernetes namespace, so that no shim or container outlives the cluster.
func removeTasks(address string) error {
	ctr := func(args ...string) (string, error) {
		return runFor(10*time.Second, "ctr", append([]string{"--address", address, "--namespace", "k8s.io"}, args...)...)
	}
	var errs []error
	out, err := ctr("tasks", "list", "--quiet")
	if err != nil {
		return err
	}
	for _, id := range strings.Fields(out) {
		_, _ = ctr("tasks", "kill", "--signal", "SIGKILL", id)
		// A task can be deleted only once it stopped: retry for a moment.
		var derr error
		for i := 0; i < 50; i++ {
			if _, derr = ctr("tasks", "delete", id); derr == nil {
				break
			}
			time.Sleep(100 * time.Millisecond) // waiting for another process's task to stop
		}
		errs = append(errs, derr)
	}
	out, err = ctr("containers", "list", "--quiet")
	if err != nil {
		return errors.Join(append(errs, err)...)
	}
	for _, id := range strings.Fields(out) {
		_, err := ctr("containers", "delete", id)
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// killShims kills containerd-shim processes started for this containerd (their command
// line names its address) that are still there after it stopped.
func killShims(address string) error {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return err
	}
	var errs []error
	for _, e := range ents {
		pid := 0
		if _, err := fmt.Sscanf(e.Name(), "%d", &pid); err != nil || pid <= 0 {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(string(cmdline), "\x00")
		if len(args) == 0 || !strings.HasPrefix(filepath.Base(args[0]), "containerd-shim") {
			continue
		}
		for _, a := range args {
			if a == address {
				exe, _ := os.Readlink(filepath.Join("/proc", e.Name(), "exe"))
				errs = append(errs, stopPID("containerd-shim", pidRecord{PID: pid, Exe: strings.TrimSuffix(exe, " (deleted)")}, 5*time.Second))
				break
			}
		}
	}
	return errors.Join(errs...)
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
