package child

import (
	"fmt"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"multireg.dev/multireg/e2e/internal/wait"
)

func start(t *testing.T, script string) *Process {
	t.Helper()
	p, err := Start("sh", exec.Command("sh", "-c", script))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Kill)
	return p
}

// ready waits until the script has set its trap and said so.
func ready(t *testing.T, p *Process) {
	t.Helper()
	wait.For(t, 10*time.Second, "the script's trap", func() bool { return strings.Contains(p.Output(), "ready") })
}

func TestWaitAndOutput(t *testing.T) {
	p := start(t, "echo out; echo err >&2; exit 3")
	if code, err := p.Wait(10 * time.Second); code != 3 || err != nil {
		t.Errorf("Wait: %d, %v; want exit code 3", code, err)
	}
	if !p.Exited() || p.Err() == nil {
		t.Errorf("Exited %v, Err %v after the exit", p.Exited(), p.Err())
	}
	if out := p.Output(); out != "out\nerr\n" && out != "err\nout\n" {
		t.Errorf("Output %q, want both lines", out)
	}
}

func TestWaitSignaled(t *testing.T) {
	p := start(t, "exec sleep 60")
	if _, err := p.Wait(50 * time.Millisecond); err == nil || p.Exited() {
		t.Errorf("Wait returned %v on a running process", err)
	}
	if err := p.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if code, err := p.Wait(10 * time.Second); code != -int(syscall.SIGKILL) || err != nil {
		t.Errorf("Wait after SIGKILL: %d, %v; want %d", code, err, -int(syscall.SIGKILL))
	}
}

func TestStop(t *testing.T) {
	// Exits 0 on SIGTERM.
	p := start(t, "trap 'exit 0' TERM; echo ready; while :; do sleep 0.01; done")
	ready(t, p)
	if err := p.Stop(10 * time.Second); err != nil || p.Err() != nil {
		t.Errorf("Stop of a process that exits 0 on SIGTERM: %v, exit %v", err, p.Err())
	}
	if !p.Exited() {
		t.Error("Stop returned before the exit")
	}

	// Dies of SIGTERM: stopped, with the signal in Err.
	r := start(t, "exec sleep 60")
	if err := r.Stop(10 * time.Second); err != nil || r.Err() == nil || !strings.Contains(r.Err().Error(), "terminated") {
		t.Errorf("Stop of a process that dies of SIGTERM: %v, exit %v", err, r.Err())
	}

	// Ignores SIGTERM: killed after the grace.
	q := start(t, "trap '' TERM; echo ready; while :; do sleep 0.01; done")
	ready(t, q)
	err := q.Stop(100 * time.Millisecond)
	if err == nil || !strings.Contains(err.Error(), "killed") || !q.Exited() {
		t.Errorf("Stop of a process that ignores SIGTERM: %v, exited %v", err, q.Exited())
	}
	if again := q.Stop(time.Minute); again != err {
		t.Errorf("second Stop: %v, want the first's %v", again, err)
	}
}

func TestLines(t *testing.T) {
	var got []string
	w := Lines(func(line []byte) { got = append(got, string(line)) })
	for _, s := range []string{"a", "b\nc", "\n\nd\n", "e"} {
		fmt.Fprint(w, s)
	}
	if want := []string{"ab", "c", "", "d"}; fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("lines %q, want %q (no partial last line)", got, want)
	}
}
