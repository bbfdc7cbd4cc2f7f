// Package child runs the processes that the end-to-end tests and their commands start and own
// (multireg under test, the benchmark's endpoint server): start, capture what they write, stop
// with a grace period, and wait for the exit. Whoever starts a Process waits for it: Stop or
// Kill ends it, and every method that ends it returns only once it is gone.
package child

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Process is a started child process. Its methods are safe for concurrent use.
type Process struct {
	name string
	cmd  *exec.Cmd
	out  *syncBuffer   // what it wrote to the outputs its caller left unset
	done chan struct{} // closed once cmd.Wait has returned
	err  error         // cmd.Wait's result, set before done is closed
	once sync.Once     // Stop's
	stop error         // Stop's result
}

// Start starts cmd, named name in errors. The outputs that cmd leaves nil (Stdout, Stderr)
// are kept, together, for Output. A goroutine waits for the exit; Done is closed after it.
func Start(name string, cmd *exec.Cmd) (*Process, error) {
	p := &Process{name: name, cmd: cmd, out: &syncBuffer{}, done: make(chan struct{})}
	if cmd.Stdout == nil {
		cmd.Stdout = p.out
	}
	if cmd.Stderr == nil {
		cmd.Stderr = p.out
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// PID returns the process's id.
func (p *Process) PID() int { return p.cmd.Process.Pid }

// Done is closed once the process has exited and its outputs are copied.
func (p *Process) Done() <-chan struct{} { return p.done }

// Exited reports whether the process has exited.
func (p *Process) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Err returns the result of waiting for the process (nil for exit status 0) once Done is
// closed, and nil before.
func (p *Process) Err() error {
	select {
	case <-p.done:
		return p.err
	default:
		return nil
	}
}

// Output returns what the process wrote so far to the outputs its caller left unset.
func (p *Process) Output() string { return p.out.String() }

// Signal sends sig to the process.
func (p *Process) Signal(sig os.Signal) error { return p.cmd.Process.Signal(sig) }

// Kill kills the process, unless it has exited, and waits for its exit.
func (p *Process) Kill() {
	if !p.Exited() {
		_ = p.cmd.Process.Kill()
	}
	<-p.done
}

// Wait waits up to timeout for the exit and returns the exit code: the negated signal number
// if a signal ended the process.
func (p *Process) Wait(timeout time.Duration) (int, error) {
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-p.done:
	case <-t.C:
		return 0, fmt.Errorf("%s did not exit within %v", p.name, timeout)
	}
	var exit *exec.ExitError
	switch {
	case errors.As(p.err, &exit):
		if ws, ok := exit.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			return -int(ws.Signal()), nil
		}
		return exit.ExitCode(), nil
	case p.err != nil:
		return 0, fmt.Errorf("wait for %s: %w", p.name, p.err)
	}
	return 0, nil
}

// killWait bounds Stop's wait after SIGKILL: a process stuck in the kernel (an unanswered
// mount, say) must not hang a teardown.
const killWait = 10 * time.Second

// Stop sends SIGTERM (unless the process has exited), waits up to grace, then kills the
// process and waits up to killWait for its exit. It returns an error only if it had to kill
// the process: how a process that exited by itself ended is Err's. Later calls return the
// first call's result.
func (p *Process) Stop(grace time.Duration) error {
	p.once.Do(func() {
		if !p.Exited() {
			_ = p.cmd.Process.Signal(syscall.SIGTERM)
		}
		t := time.NewTimer(grace)
		defer t.Stop()
		select {
		case <-p.done:
			return
		case <-t.C:
		}
		_ = p.cmd.Process.Kill()
		select {
		case <-p.done:
			p.stop = fmt.Errorf("%s did not exit within %v of SIGTERM; killed", p.name, grace)
		case <-time.After(killWait):
			p.stop = fmt.Errorf("%s (pid %d) still runs %v after SIGKILL", p.name, p.PID(), killWait)
		}
	})
	return p.stop
}

// syncBuffer is a bytes.Buffer that one goroutine may write while others read.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Lines returns an io.Writer that calls fn with each complete line written to it, without
// its newline; a last line without one is never passed. Writes may come from several
// goroutines (a process's stdout and stderr): fn is called for one line at a time.
func Lines(fn func(line []byte)) io.Writer { return &lineWriter{fn: fn} }

type lineWriter struct {
	mu      sync.Mutex
	partial []byte
	fn      func(line []byte)
}

func (w *lineWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.partial = append(w.partial, p...)
	for {
		i := bytes.IndexByte(w.partial, '\n')
		if i < 0 {
			break
		}
		w.fn(w.partial[:i])
		w.partial = w.partial[i+1:]
	}
	return len(p), nil
}

// Named returns the pid of a child process of parent whose command name is name (as
// /proc/PID/stat gives it: cut at 15 bytes), and whether there is one.
func Named(parent int, name string) (int, bool) {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return 0, false
	}
	for _, e := range ents {
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		s := string(b) // pid (comm) state ppid …
		open, close := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
		if open < 0 || close < open || !strings.HasPrefix(name, s[open+1:close]) {
			continue
		}
		if f := strings.Fields(s[close+1:]); len(f) > 1 && f[1] == strconv.Itoa(parent) {
			pid, err := strconv.Atoi(e.Name())
			return pid, err == nil
		}
	}
	return 0, false
}
