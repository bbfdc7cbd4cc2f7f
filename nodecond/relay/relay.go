//go:build linux

// Package relay is multireg's side of the node condition: it runs the agent process
// (cmd/multireg-nodecond, nodecond's protocol), tells it the drivers' state each time it
// changes, and keeps what the agent says for /status and the metrics. multireg itself links
// no Kubernetes client: the agent does.
package relay

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"multireg.dev/multireg/internal/pause"
	"multireg.dev/multireg/nodecond"
	"multireg.dev/multireg/registrar"
)

// Options configure a Relay.
type Options struct {
	// Agent is the agent's executable; Args its arguments (nodecond.AgentArgs); Type the
	// condition's type.
	Agent string
	Args  []string
	Type  string
	// Stderr receives the agent's log lines, as multireg's own.
	Stderr io.Writer
	Log    *slog.Logger
}

// Source is what the condition is decided from: the drivers and kubelet's pod-resources view
// (registrar.Supervisor), and channels closed at the next change of either (Changed and
// PodResourcesChanged; a nil one never closes).
type Source struct {
	Drivers             func() []registrar.DriverStatus
	PodResources        func() (registrar.PodResources, bool)
	Changed             func() <-chan struct{}
	PodResourcesChanged func() <-chan struct{}
}

// AgentPath is the agent beside the running executable.
func AgentPath() (string, error) {
	exe, err := os.Executable()
	if err != nil {
		return "", err
	}
	return filepath.Join(filepath.Dir(exe), nodecond.AgentName), nil
}

// Agent is what multireg knows of its agent process.
type Agent struct {
	// Running: an agent runs and has said Ready. Starts counts the agents started; LastExit
	// says how the last one ended ("" while none has).
	Running  bool
	Starts   int
	LastExit string
}

// Relay runs the agent and speaks to it.
type Relay struct {
	o   Options
	log *slog.Logger

	mu    sync.Mutex
	st    nodecond.Status
	agent Agent
	cur   *proc // the agent process running, nil between two
}

// proc is one agent process.
type proc struct {
	cmd       *exec.Cmd
	in        io.WriteCloser
	enc       *json.Encoder
	done      chan struct{} // closed once it has exited and its output is read
	exit      error
	withdrawn chan nodecond.Withdrawn
}

// How often an agent that ended is started again: after 1 s, doubling to 30 s.
const (
	restartMin = time.Second
	restartMax = 30 * time.Second
)

// readyTimeout bounds the wait for an agent's Ready.
const readyTimeout = 15 * time.Second

// inputEvery spaces the inputs sent to the agent while the drivers change (a thousand drivers
// starting).
const inputEvery = 100 * time.Millisecond

// New returns a relay; Start or Run starts its agent.
func New(o Options) *Relay {
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	if o.Stderr == nil {
		o.Stderr = io.Discard
	}
	return &Relay{o: o, log: o.Log}
}

// Start starts the agent, unless one runs, and waits for its Ready: an agent that cannot
// start (its executable missing, its kubeconfig unreadable, no service account in the pod) is
// an error that says why, in the agent's own words.
func (r *Relay) Start() error {
	r.mu.Lock()
	running := r.cur != nil
	r.mu.Unlock()
	if running {
		return nil
	}
	p, err := r.start()
	if err != nil {
		return err
	}
	r.mu.Lock()
	r.cur = p
	r.mu.Unlock()
	return nil
}

// start starts one agent process and waits for its Ready.
func (r *Relay) start() (*proc, error) {
	cmd := exec.Command(r.o.Agent, r.o.Args...)
	// The agent ends with multireg, whatever ends multireg.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	var tail tailWriter
	cmd.Stderr = io.MultiWriter(r.o.Stderr, &tail)
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("the node condition's agent %s: %w", r.o.Agent, err)
	}
	p := &proc{cmd: cmd, in: in, enc: json.NewEncoder(in), done: make(chan struct{}), withdrawn: make(chan nodecond.Withdrawn, 1)}
	ready := make(chan error, 1)
	go func() { // owned by p: done closes when it returns
		defer close(p.done)
		r.read(p, out, ready)
		p.exit = cmd.Wait()
	}()
	r.mu.Lock()
	r.agent.Starts++
	r.mu.Unlock()
	timer := time.NewTimer(readyTimeout)
	defer timer.Stop()
	select {
	case err := <-ready:
		if err == nil {
			r.mu.Lock()
			r.agent.Running = true
			r.mu.Unlock()
			return p, nil
		}
		p.stop()
		return nil, err
	case <-p.done:
		return nil, fmt.Errorf("the node condition's agent exited at start (%v): %s", p.exit, tail.String())
	case <-timer.C:
		p.stop()
		return nil, fmt.Errorf("the node condition's agent said nothing within %s: %s", readyTimeout, tail.String())
	}
}

// read reads the agent's messages until its output ends, and says on ready whether its first
// was a Ready of this protocol.
func (r *Relay) read(p *proc, out io.Reader, ready chan<- error) {
	dec := json.NewDecoder(bufio.NewReader(out))
	first := true
	for {
		var m nodecond.FromAgent
		if err := dec.Decode(&m); err != nil {
			if first {
				ready <- fmt.Errorf("the node condition's agent: no Ready: %w", err)
			}
			io.Copy(io.Discard, out)
			return
		}
		switch {
		case first:
			first = false
			if m.Ready == nil || m.Ready.Protocol != nodecond.AgentProtocol {
				ready <- fmt.Errorf("the node condition's agent is of another build (%+v): reinstall multireg", m)
				io.Copy(io.Discard, out)
				return
			}
			ready <- nil
		case m.Status != nil:
			r.mu.Lock()
			r.st = *m.Status
			r.mu.Unlock()
		case m.Withdrawn != nil:
			p.withdrawn <- *m.Withdrawn
		}
	}
}

// Run tells the agent src's state each time it changes, and starts an agent when none runs
// (again, after a pause, when one ended), until ctx ends. The agent then runs on until Stop.
func (r *Relay) Run(ctx context.Context, src Source) error {
	var last time.Time
	wait := time.Duration(0) // the first agent of a Run starts at once
	for {
		r.mu.Lock()
		p := r.cur
		r.mu.Unlock()
		if p == nil { // none yet, or the last one ended: another, after a pause
			if !pause.For(ctx, wait) {
				return nil
			}
			wait = max(wait, restartMin)
			np, err := r.start()
			if err != nil {
				r.log.Error("the node condition's agent did not start; trying again", "err", err, "retryIn", min(2*wait, restartMax))
				wait = min(2*wait, restartMax)
				continue
			}
			wait = restartMin
			r.mu.Lock()
			r.cur = np
			r.mu.Unlock()
			p = np
		}
		changed, podChanged := src.Changed(), src.PodResourcesChanged()
		if d := inputEvery - time.Since(last); d > 0 {
			if !pause.For(ctx, d) {
				return nil
			}
		}
		last = time.Now()
		if err := p.enc.Encode(nodecond.ToAgent{Input: input(src)}); err != nil {
			r.ended(p)
			continue
		}
		select {
		case <-ctx.Done():
			return nil
		case <-p.done:
			r.ended(p)
		case <-changed:
		case <-podChanged:
		}
	}
}

// ended records that p has ended, once its output is read.
func (r *Relay) ended(p *proc) {
	<-p.done
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.cur == p {
		r.cur = nil
	}
	r.agent.Running = false
	r.agent.LastExit = fmt.Sprint(p.exit)
	r.log.Error("the node condition's agent ended; it is started again", "err", p.exit)
}

// input is what the condition is decided from now.
func input(src Source) *nodecond.Input {
	in := &nodecond.Input{}
	for _, d := range src.Drivers() {
		nd := nodecond.Driver{Name: d.Name, Type: d.Type, Required: d.Required, Phase: string(d.Phase), Since: d.Since,
			Absent: d.Absent, EndpointUp: d.EndpointUp, EndpointSince: d.EndpointSince, LastError: d.LastError}
		if k := d.Kubelet; k != nil {
			n := k.Devices
			nd.Devices = &n
		}
		in.Drivers = append(in.Drivers, nd)
	}
	if p, ok := src.PodResources(); ok {
		in.PodResources, in.Answers = true, p.Answers
	}
	return in
}

// Stop stops the agent, after Run has returned. With withdraw, every registration is gone
// (--cleanup-on-exit): the agent first writes the condition Unknown, within ctx.
func (r *Relay) Stop(ctx context.Context, withdraw bool) error {
	r.mu.Lock()
	p := r.cur
	r.cur = nil
	r.mu.Unlock()
	if p == nil {
		return nil
	}
	var err error
	if withdraw {
		if err = p.enc.Encode(nodecond.ToAgent{Withdraw: true}); err == nil {
			select {
			case w := <-p.withdrawn:
				if w.Error != "" {
					err = errors.New(w.Error)
				}
			case <-p.done:
				err = fmt.Errorf("the agent ended: %v", p.exit)
			case <-ctx.Done():
				err = ctx.Err()
			}
		}
	}
	p.stop()
	return err
}

// stop closes the agent's input, which ends it, and waits for it; an agent that does not end
// within stopTimeout is killed.
func (p *proc) stop() {
	p.in.Close()
	t := time.NewTimer(stopTimeout)
	defer t.Stop()
	select {
	case <-p.done:
	case <-t.C:
		p.cmd.Process.Kill()
		<-p.done
	}
}

// stopTimeout bounds an agent's end once its input is closed.
const stopTimeout = 5 * time.Second

// Type is the condition's type.
func (r *Relay) Type() string { return r.o.Type }

// Status returns what the agent last said, and what multireg knows of the agent.
func (r *Relay) Status() (nodecond.Status, Agent) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.st, r.agent
}

// tailWriter keeps the last lines written to it: the agent's words when it fails at start.
type tailWriter struct {
	mu sync.Mutex
	b  []byte
}

func (t *tailWriter) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b = append(t.b, p...)
	if len(t.b) > 4096 {
		t.b = t.b[len(t.b)-4096:]
	}
	return len(p), nil
}

func (t *tailWriter) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return strings.TrimSpace(string(t.b))
}
