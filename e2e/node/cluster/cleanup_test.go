package cluster

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"multireg.dev/multireg/e2e/node/hostpaths"
)

// Cleanup, from the state file alone (as cmd/cleanup runs it after a test binary died):
// a recorded process that still runs is stopped, a recorded PID that now runs another
// program or started at another time is left alone, every mount below the directory is undone (deepest first, also a
// path mounted twice), a recorded host file is removed and a recorded host directory
// removed only if empty.
func TestCleanupFromStateFile(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to mount")
	}
	dir, err := os.MkdirTemp("/tmp", "mrc.")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = hostpaths.UnmountBelow(dir); os.RemoveAll(dir) })
	host := t.TempDir()

	sleepBin, err := exec.LookPath("sleep")
	if err != nil {
		t.Fatal(err)
	}
	ours := exec.Command(sleepBin, "300")
	other := exec.Command(sleepBin, "300")
	later := exec.Command(sleepBin, "300")
	for _, c := range []*exec.Cmd{ours, other, later} {
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
	}
	oursDone := make(chan error, 1)
	go func() { oursDone <- ours.Wait() }()
	t.Cleanup(func() {
		for _, c := range []*exec.Cmd{other, later} {
			_ = c.Process.Kill()
			_ = c.Wait()
		}
	})
	laterStart, err := startTime(later.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}

	// Mounts: a bind of a onto itself (as kubelet does with its root), and b twice.
	a, b := filepath.Join(dir, "kubelet"), filepath.Join(dir, "kubelet", "pods", "x")
	for _, p := range []string{a, b} {
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, m := range [][2]string{{a, a}, {host, b}, {host, b}} {
		if err := unix.Mount(m[0], m[1], "", unix.MS_BIND, ""); err != nil {
			t.Fatalf("mount %s on %s: %v", m[0], m[1], err)
		}
	}

	hostFile := filepath.Join(host, "kubelet.sock")
	emptyDir := filepath.Join(host, "device-plugins")
	busyDir := filepath.Join(host, "netns")
	for _, d := range []string{emptyDir, busyDir} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	foreign := filepath.Join(busyDir, "someone-elses")
	for _, f := range []string{hostFile, foreign} {
		if err := os.WriteFile(f, nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}

	st := newStateStore(dir)
	if err := st.update(func(s *state) {
		s.PIDs["kubelet"] = pidRecord{PID: ours.Process.Pid, Exe: sleepBin}
		// The same program, started at another time: a recycled PID too.
		s.PIDs["multireg-host"] = pidRecord{PID: later.Process.Pid, Exe: sleepBin, Start: laterStart + 1}
		// The same PID's program is not what was recorded: a recycled PID.
		s.PIDs["etcd"] = pidRecord{PID: other.Process.Pid, Exe: "/usr/bin/etcd"}
		s.HostFiles = []string{hostFile}
		s.HostDirs = []string{emptyDir, busyDir}
	}); err != nil {
		t.Fatal(err)
	}

	err = Cleanup(dir)
	// The only failure: the directory that holds a file that is not ours stays.
	if err == nil || !strings.Contains(err.Error(), busyDir) || strings.Count(err.Error(), "\n") != 0 {
		t.Errorf("Cleanup: %v; want exactly one error, naming %s", err, busyDir)
	}
	// Cleanup returns once the process is a zombie; the test's Wait reaps it a moment later.
	select {
	case <-oursDone:
	case <-time.After(5 * time.Second):
		t.Errorf("the recorded process (pid %d) still runs", ours.Process.Pid)
	}
	if !pidIs(pidRecord{PID: other.Process.Pid, Exe: sleepBin}) {
		t.Errorf("a process whose PID was recorded for another program was stopped")
	}
	if !pidIs(pidRecord{PID: later.Process.Pid, Exe: sleepBin, Start: laterStart}) {
		t.Errorf("a process whose PID was recorded with another start time was stopped")
	}
	mounts, _ := os.ReadFile("/proc/self/mountinfo")
	if strings.Contains(string(mounts), dir) {
		t.Errorf("mounts below %s remain:\n%s", dir, mounts)
	}
	for _, gone := range []string{hostFile, emptyDir} {
		if _, err := os.Lstat(gone); !os.IsNotExist(err) {
			t.Errorf("%s: still there (%v)", gone, err)
		}
	}
	if _, err := os.Stat(foreign); err != nil {
		t.Errorf("a file Cleanup does not own was removed: %v", err)
	}
	// Idempotent: a second run finds nothing more to do than the same refusal.
	if err := Cleanup(dir); err == nil || !strings.Contains(err.Error(), busyDir) {
		t.Errorf("second Cleanup: %v", err)
	}
}

// Cleanup of a directory without a state file (nothing was started) does nothing.
func TestCleanupWithoutState(t *testing.T) {
	if err := Cleanup(t.TempDir()); err != nil {
		t.Fatal(err)
	}
}

// Start refuses a directory that holds another run's state, before it starts or changes
// anything (a teardown would undo the other run).
func TestStartRefusesADirectoryWithState(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("Start refuses non-root first")
	}
	dir := t.TempDir()
	state := []byte(`{"pids":{"kubelet":{"pid":1,"exe":"/sbin/init"}}}`)
	if err := os.WriteFile(filepath.Join(dir, stateFile), state, 0o644); err != nil {
		t.Fatal(err)
	}
	c, err := Start(t.Context(), Options{Dir: dir, BinDir: "/nonexistent"})
	if c != nil || err == nil || !strings.Contains(err.Error(), "holds a cluster's state already") {
		t.Fatalf("Start = %v, %v; want a refusal naming the state", c, err)
	}
	if got, _ := os.ReadFile(filepath.Join(dir, stateFile)); string(got) != string(state) {
		t.Errorf("the other run's state was changed: %s", got)
	}
}
