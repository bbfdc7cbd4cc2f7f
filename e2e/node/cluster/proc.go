package cluster

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"multireg.dev/multireg/e2e/internal/child"
	"multireg.dev/multireg/e2e/internal/wait"
)

// proc is one component of the cluster, started by this process and waited for by it.
type proc struct {
	*child.Process
	log string
}

// StartProc starts bin with args as a child process in its own process group (a Ctrl-C of
// `make` reaches the test, which stops its processes in order, instead of killing them all
// at once mid-teardown), with its output appended to logPath.
func StartProc(name, logPath, bin string, args ...string) (*child.Process, error) {
	return StartProcEnv(name, logPath, bin, nil, args...)
}

// StartProcEnv is StartProc with env added to this process's environment.
func StartProcEnv(name, logPath, bin string, env []string, args ...string) (*child.Process, error) {
	if abs, err := filepath.Abs(bin); err == nil {
		bin = abs
	}
	f, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	defer f.Close() // the child has its own descriptor
	cmd := exec.Command(bin, args...)
	if env != nil {
		cmd.Env = append(os.Environ(), env...)
	}
	cmd.Stdout = f
	cmd.Stderr = f
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	return child.Start(name, cmd)
}

// startProc starts a component (StartProc), its output in logDir/name.log, and records its
// PID in the state file so that Cleanup can stop it even if this process dies.
func (c *Cluster) startProc(name, bin string, args ...string) (*proc, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.stopped {
		return nil, fmt.Errorf("start %s: the cluster is being torn down", name)
	}
	logPath := filepath.Join(c.logDir(), name+".log")
	cp, err := StartProc(name, logPath, bin, args...)
	if err != nil {
		return nil, err
	}
	p := &proc{Process: cp, log: logPath}
	c.procs[name] = p
	return p, c.Track(name, cp.PID())
}

// Track records a process the caller started (multireg on the host, say) in the state file,
// so that Cleanup stops it too, before the cluster's components, should the caller die
// without stopping it. The process must be running.
func (c *Cluster) Track(name string, pid int) error {
	exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid))
	if err != nil {
		return fmt.Errorf("track %s: %w", name, err)
	}
	start, err := startTime(pid)
	if err != nil {
		return fmt.Errorf("track %s: %w", name, err)
	}
	return c.state.update(func(s *state) { s.PIDs[name] = pidRecord{PID: pid, Exe: exe, Start: start} })
}

// startTime is a process's start time, in clock ticks since boot (field 22 of
// /proc/PID/stat).
func startTime(pid int) (uint64, error) {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// "pid (comm) S ppid …": comm may hold spaces; the fields after it are plain.
	i := strings.LastIndexByte(string(stat), ')')
	if i < 0 {
		return 0, fmt.Errorf("/proc/%d/stat: %q", pid, stat)
	}
	f := strings.Fields(string(stat[i+1:]))
	if len(f) < 20 {
		return 0, fmt.Errorf("/proc/%d/stat: %q", pid, stat)
	}
	return strconv.ParseUint(f[19], 10, 64) // field 22 overall, the 20th after comm
}

// proc returns the named component, nil if it was never started.
func (c *Cluster) proc(name string) *proc {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.procs[name]
}

// stopPID stops a process this package started in an earlier run (recorded in the state
// file), after checking that the PID still names the same program.
func stopPID(name string, rec pidRecord, grace time.Duration) error {
	if !pidIs(rec) {
		return nil
	}
	_ = syscall.Kill(rec.PID, syscall.SIGTERM)
	if waitGone(rec, grace) {
		return nil
	}
	_ = syscall.Kill(rec.PID, syscall.SIGKILL)
	if waitGone(rec, 10*time.Second) {
		return nil
	}
	return fmt.Errorf("%s (pid %d) still runs after SIGKILL", name, rec.PID)
}

// pidIs reports whether rec.PID is alive and is the recorded process: the same program,
// started at the same time (not a recycled PID). A zombie counts as gone.
func pidIs(rec pidRecord) bool {
	exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", rec.PID))
	if err != nil {
		return false
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", rec.PID))
	if err != nil {
		return false
	}
	// "pid (comm) S ...": the state letter follows the last ')'.
	if i := strings.LastIndexByte(string(stat), ')'); i > 0 && i+2 < len(stat) && stat[i+2] == 'Z' {
		return false
	}
	if rec.Start != 0 {
		if start, err := startTime(rec.PID); err != nil || start != rec.Start {
			return false
		}
	}
	want, err := filepath.EvalSymlinks(rec.Exe)
	if err != nil {
		want = rec.Exe
	}
	return strings.TrimSuffix(exe, " (deleted)") == want
}

func waitGone(rec pidRecord, d time.Duration) bool {
	return wait.Until(d, 50*time.Millisecond, func() bool { return !pidIs(rec) })
}

// Tail returns the last n lines of a file, for failure reports.
func Tail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	return LastLines(string(b), n)
}

// LastLines returns the last n lines of s.
func LastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// run runs a short command and returns its combined output; the error includes it.
func run(ctx context.Context, name string, args ...string) (string, error) {
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return string(out), nil
}

// runFor is run with a time limit.
func runFor(d time.Duration, name string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	return run(ctx, name, args...)
}

var errNotRoot = errors.New("the single-node cluster needs root: it mounts, sets sysctls, runs containerd and creates a network bridge")

func itoa(i int) string { return strconv.Itoa(i) }
