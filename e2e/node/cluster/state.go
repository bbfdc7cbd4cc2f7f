package cluster

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/node/hostpaths"
)

// stateFile, in the cluster's directory, records everything Cleanup must undo: the PIDs it
// started, the sysctls kubelet changes (with their values before), the bridge, and the files
// outside the directory that kubelet writes whatever its --root-dir. It is written before each
// change, so that `go run ./cmd/cleanup DIR` can undo a run that died without its teardown.
const stateFile = "state.json"

// pidRecord identifies a process: its PID, its program (absolute) and its start time in
// clock ticks since boot, so that a recycled PID is never taken for it.
type pidRecord struct {
	PID   int    `json:"pid"`
	Exe   string `json:"exe"`
	Start uint64 `json:"start"`
}

type state struct {
	PIDs map[string]pidRecord `json:"pids"`
	// Sysctls maps a /proc/sys path to its value before the cluster started.
	Sysctls map[string]string `json:"sysctls"`
	Bridge  string            `json:"bridge,omitempty"`
	// CNINetwork is the pods' network name, which names the CNI results cached for it.
	CNINetwork string `json:"cniNetwork,omitempty"`
	// ContainerdAddress is the private containerd's socket, for removing its tasks.
	ContainerdAddress string `json:"containerdAddress,omitempty"`
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

// get returns a copy of the state, safe to read while others update it.
func (st *stateStore) get() state {
	st.mu.Lock()
	defer st.mu.Unlock()
	s := st.s
	s.PIDs = maps.Clone(st.s.PIDs)
	s.Sysctls = maps.Clone(st.s.Sysctls)
	s.HostFiles = slices.Clone(st.s.HostFiles)
	s.HostDirs = slices.Clone(st.s.HostDirs)
	return s
}

// The sysctls the cluster changes: those kubelet's container manager sets at start (unless
// protectKernelDefaults) and IP forwarding, which the CNI bridge plugin turns on for its
// gateway.
var kubeletSysctls = []string{
	"vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
	"kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes", "net/ipv4/ip_forward",
}

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

// cniResults is where containerd's CNI library caches each pod's network result.
const cniResults = "/var/lib/cni/results"

// The cluster's components in the order they are stopped: the clients of the API server and
// containerd, then (after containerd's tasks are removed) the servers.
var (
	clientComponents = []string{"kube-scheduler", "kube-controller-manager", "kubelet"}
	serverComponents = []string{"kube-apiserver", "containerd", "etcd"}
)

// stopTracked stops the processes callers recorded with Track (multireg on the host): they
// use the cluster, so they go first.
func stopTracked(pids map[string]pidRecord) []error {
	var errs []error
	for name, rec := range pids {
		if !slices.Contains(clientComponents, name) && !slices.Contains(serverComponents, name) {
			errs = append(errs, stopPID(name, rec, 10*time.Second))
		}
	}
	return errs
}

// Cleanup undoes a cluster from its directory's state file: it stops the recorded processes
// that still run (checking each PID still runs the same program), removes the private
// containerd's leftover tasks, unmounts everything below dir and the pods' network
// namespaces, deletes the bridge, restores the sysctls and removes the host files kubelet
// wrote. It is what Stop runs after stopping the components in order, and what
// cmd/cleanup runs after a test binary that died. It reports every step that failed.
func Cleanup(dir string) error {
	if abs, err := filepath.Abs(dir); err == nil {
		dir = abs // mount points and link targets are absolute
	}
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
	errs := stopTracked(s.PIDs)
	for _, name := range clientComponents {
		if rec, ok := s.PIDs[name]; ok {
			errs = append(errs, stopPID(name, rec, 10*time.Second))
		}
	}
	if s.ContainerdAddress != "" {
		if rec, ok := s.PIDs["containerd"]; ok && pidIs(rec) {
			errs = append(errs, removeTasks(s.ContainerdAddress))
		}
	}
	for _, name := range serverComponents {
		if rec, ok := s.PIDs[name]; ok {
			errs = append(errs, stopPID(name, rec, 10*time.Second))
		}
	}
	if s.ContainerdAddress != "" {
		errs = append(errs, killShims(s.ContainerdAddress))
		// A container whose shim was killed (containerd gone before its tasks) still runs:
		// runc, whose state is below dir, stops it.
		errs = append(errs, deleteContainers(filepath.Join(dir, "containerd", "runc", "k8s.io")))
	}
	errs = append(errs, hostpaths.UnmountBelow(dir))
	errs = append(errs, removeLinksInto("/var/log/containers", dir))
	// The CNI results containerd caches per pod, left when a pod was never torn down (a
	// test binary killed while pods ran): named after the cluster's own network.
	if s.CNINetwork != "" {
		leftover, _ := filepath.Glob(filepath.Join(cniResults, s.CNINetwork+"-*"))
		for _, f := range leftover {
			if err := os.Remove(f); err != nil && !errors.Is(err, fs.ErrNotExist) {
				errs = append(errs, err)
			}
		}
	}
	if s.Bridge != "" {
		if _, err := os.Stat("/sys/class/net/" + s.Bridge); err == nil {
			_, err := runFor(10*time.Second, "ip", "link", "delete", s.Bridge)
			errs = append(errs, err)
		}
	}
	for k, v := range s.Sysctls {
		if now, err := os.ReadFile("/proc/sys/" + k); err == nil && strings.TrimSpace(string(now)) == v {
			continue
		}
		errs = append(errs, os.WriteFile("/proc/sys/"+k, []byte(v), 0o644))
	}
	for _, f := range s.HostFiles {
		if err := os.Remove(f); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	errs = append(errs, hostpaths.RemoveEmptyDirs(s.HostDirs))
	return errors.Join(errs...)
}

// removeTasks kills and deletes every task and container of the private containerd's
// Kubernetes namespace, so that no shim or container outlives the cluster.
func removeTasks(address string) error {
	deadline := time.Now().Add(time.Minute)
	ctr := func(args ...string) (string, error) {
		d := min(10*time.Second, time.Until(deadline))
		if d <= 0 {
			return "", fmt.Errorf("ctr %s: no time left of removeTasks' minute", strings.Join(args, " "))
		}
		return runFor(d, "ctr", append([]string{"--address", address, "--namespace", "k8s.io"}, args...)...)
	}
	var errs []error
	out, err := ctr("tasks", "list", "--quiet")
	if err != nil {
		return err
	}
	for _, id := range strings.Fields(out) {
		_, _ = ctr("tasks", "kill", "--signal", "SIGKILL", id)
		// A task can be deleted only once it stopped: retry until the deadline.
		var derr error
		// A task gone meanwhile (kubelet stopping its pod) is done.
		wait.Until(time.Until(deadline), 100*time.Millisecond, func() bool {
			_, derr = ctr("tasks", "delete", id)
			if derr != nil && strings.Contains(derr.Error(), "not found") {
				derr = nil
			}
			return derr == nil
		})
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

// deleteContainers force-deletes (SIGKILL, then the state) every container runc knows in
// root, the cluster's own runc state directory.
func deleteContainers(root string) error {
	if _, err := os.Stat(root); errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	runc := mustLookPath("runc")
	out, err := runFor(10*time.Second, runc, "--root", root, "list", "--quiet")
	if err != nil {
		return err
	}
	var errs []error
	for _, id := range strings.Fields(out) {
		_, err := runFor(10*time.Second, runc, "--root", root, "delete", "--force", id)
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// removeLinksInto removes the symbolic links in dir whose target lies below root (kubelet's
// legacy container-log links point into the cluster's pod-log directory).
func removeLinksInto(dir, root string) error {
	ents, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var errs []error
	for _, e := range ents {
		p := filepath.Join(dir, e.Name())
		target, err := os.Readlink(p)
		if err != nil {
			continue // not a link
		}
		if strings.HasPrefix(filepath.Clean(target), filepath.Clean(root)+"/") {
			if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
				errs = append(errs, err)
			}
		}
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
				start, _ := startTime(pid)
				errs = append(errs, stopPID("containerd-shim", pidRecord{PID: pid, Exe: strings.TrimSuffix(exe, " (deleted)"), Start: start}, 5*time.Second))
				break
			}
		}
	}
	return errors.Join(errs...)
}
