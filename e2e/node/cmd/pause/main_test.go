package main

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"multireg.dev/multireg/e2e/internal/child"
	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/node/images"
)

// TestPause runs the built binary as PID 1 of a new PID namespace, as in a pod sandbox, and
// checks that it reaps the orphans it inherits and exits 0 on SIGTERM and on SIGINT.
func TestPause(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: pause runs as PID 1 of a new PID namespace")
	}
	if _, err := exec.LookPath("nsenter"); err != nil {
		t.Skipf("needs nsenter to start orphans in pause's PID namespace: %v", err)
	}
	bin, err := images.BuildPause(t.Context(), t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGINT} {
		t.Run(sig.String(), func(t *testing.T) {
			cmd := exec.Command(bin)
			cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID}
			p, err := child.Start("pause", cmd)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(p.Kill)

			// Signals that arrive before pause's signal.Notify are lost or fatal, so the
			// first orphan it reaps is also the sign that it is ready for sig.
			waitReaped(t, p.PID())

			if err := p.Signal(sig); err != nil {
				t.Fatal(err)
			}
			select {
			case <-p.Done():
				if err := p.Err(); err != nil {
					t.Errorf("pause after %v: %v, want exit status 0", sig, err)
				}
			case <-time.After(10 * time.Second):
				t.Fatalf("pause still runs 10s after %v", sig)
			}
		})
	}
}

// waitReaped starts an orphan in the PID namespace of pid, which pause (its PID 1) inherits,
// lets it exit, and waits until pause has no child left. A SIGCHLD that arrives before pause
// is ready is lost, so it tries again with a new orphan, whose SIGCHLD reaps both.
func waitReaped(t *testing.T, pid int) {
	t.Helper()
	for attempt := 1; attempt <= 5; attempt++ {
		r, w, err := os.Pipe()
		if err != nil {
			t.Fatal(err)
		}
		// cat reads fd 3 (r) until w is closed. sh exits at once, orphaning cat to pause.
		ns := exec.Command("nsenter", "--target", strconv.Itoa(pid), "--pid", "--",
			"/bin/sh", "-c", "cat <&3 >/dev/null 2>&1 &")
		ns.ExtraFiles = []*os.File{r}
		out, err := ns.CombinedOutput()
		r.Close()
		if err != nil {
			w.Close()
			t.Fatalf("nsenter: %v: %s", err, bytes.TrimSpace(out))
		}
		if n := children(t, pid); n == 0 {
			w.Close()
			t.Fatalf("pause has no child after nsenter, want the orphaned cat")
		}
		w.Close()
		if wait.Until(2*time.Second, 10*time.Millisecond, func() bool { return children(t, pid) == 0 }) {
			return
		}
		t.Logf("attempt %d: pause still has %d children", attempt, children(t, pid))
	}
	t.Fatal("pause does not reap its children")
}

// children counts the processes whose parent is pid, zombies included.
func children(t *testing.T, pid int) int {
	t.Helper()
	stats, err := filepath.Glob("/proc/[0-9]*/stat")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, stat := range stats {
		b, err := os.ReadFile(stat)
		if errors.Is(err, os.ErrNotExist) || errors.Is(err, syscall.ESRCH) {
			continue // exited meanwhile
		}
		if err != nil {
			t.Fatal(err)
		}
		// "pid (comm) state ppid ...": comm may hold spaces and parentheses.
		fields := bytes.Fields(b[bytes.LastIndexByte(b, ')')+1:])
		if len(fields) > 1 && string(fields[1]) == strconv.Itoa(pid) {
			n++
		}
	}
	return n
}
