// Command multireg-nodecond is multireg's node-condition agent: the one process of multireg that
// speaks to the Kubernetes API. `multireg run --node-condition` starts it beside itself (the
// image holds both) and speaks to it over its standard input and output (package nodecond's
// protocol); it is not meant to be run by hand.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"multireg.dev/multireg/internal/kubeapi"
	"multireg.dev/multireg/nodecond"
	"multireg.dev/multireg/nodecond/agent"
)

// version is set at build time, as multireg's is.
var version = "devel"

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "multireg-nodecond:", err)
		os.Exit(1)
	}
}

// statusEvery spaces the statuses sent to multireg while the condition's evidence changes (a
// thousand drivers starting).
const statusEvery = 100 * time.Millisecond

// withdrawTimeout bounds the last write of the condition at an uninstall's exit.
const withdrawTimeout = 3 * time.Second

func run() error {
	fs := flag.NewFlagSet("multireg-nodecond", flag.ContinueOnError)
	typ := fs.String("node-condition", "", "the condition's type")
	node := fs.String("node-name", "", "the node's name")
	kubeconfig := fs.String("kubeconfig", "", "the API server's kubeconfig; empty: the pod's service account")
	taintFlag := fs.String("startup-taint", "", "the taint to remove once the condition is True")
	logFormat := fs.String("log-format", "text", "text or json")
	logLevel := fs.String("log-level", "info", "debug, info, warn or error")
	if err := fs.Parse(os.Args[1:]); err != nil {
		return err
	}
	if err := nodecond.CheckConditionType(*typ); err != nil {
		return fmt.Errorf("--node-condition %w", err)
	}
	if *node == "" {
		return errors.New("--node-name is required")
	}
	var taint *nodecond.Taint
	if *taintFlag != "" {
		t, err := nodecond.ParseTaint(*taintFlag)
		if err != nil {
			return fmt.Errorf("--startup-taint %w", err)
		}
		taint = &t
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(*logLevel)); err != nil {
		return fmt.Errorf("--log-level %q: %w", *logLevel, err)
	}
	opts := &slog.HandlerOptions{Level: level}
	var log *slog.Logger
	if *logFormat == "json" {
		log = slog.New(slog.NewJSONHandler(os.Stderr, opts))
	} else {
		log = slog.New(slog.NewTextHandler(os.Stderr, opts))
	}

	client, err := kubeapi.Connect(*kubeconfig, "multireg/"+version)
	if err != nil {
		return err
	}
	// SIGTERM ends the agent as multireg's end does (its standard input closes).
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()

	out := &sender{w: bufio.NewWriter(os.Stdout)}
	if err := out.send(nodecond.FromAgent{Ready: &nodecond.Ready{Protocol: nodecond.AgentProtocol}}); err != nil {
		return err
	}
	rep := agent.New(agent.Options{Client: client, Node: *node, Type: *typ, Taint: taint, Log: log})
	runCtx, stopRun := context.WithCancel(ctx)
	defer stopRun()
	var wg sync.WaitGroup
	wg.Go(func() { rep.Run(runCtx) })
	wg.Go(func() { sendStatus(runCtx, rep, out) })

	// multireg's messages, until it closes our input or asks for Withdraw.
	withdraw := make(chan struct{})
	wg.Go(func() {
		defer stopRun()
		dec := json.NewDecoder(bufio.NewReader(os.Stdin))
		for {
			var m nodecond.ToAgent
			if err := dec.Decode(&m); err != nil {
				if !errors.Is(err, io.EOF) && runCtx.Err() == nil {
					log.Error("a message from multireg that is not one", "err", err)
				}
				return
			}
			switch {
			case m.Input != nil:
				rep.SetInput(*m.Input)
			case m.Withdraw:
				close(withdraw)
				return
			}
		}
	})
	select {
	case <-withdraw:
		stopRun()
		wg.Wait()
		wctx, cancel := context.WithTimeout(context.Background(), withdrawTimeout)
		defer cancel()
		var w nodecond.Withdrawn
		if err := rep.Withdrawn(wctx); err != nil {
			w.Error = err.Error()
		}
		return out.send(nodecond.FromAgent{Withdrawn: &w})
	case <-runCtx.Done():
		wg.Wait()
		return nil
	}
}

// sendStatus sends the reporter's status to multireg each time it changes, statusEvery apart
// at most, until ctx ends.
func sendStatus(ctx context.Context, rep *agent.Reporter, out *sender) {
	for {
		changed := rep.Changed()
		st := rep.Status()
		if err := out.send(nodecond.FromAgent{Status: &st}); err != nil {
			return // multireg is gone: its input's end stops us
		}
		t := time.NewTimer(statusEvery)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		select {
		case <-ctx.Done():
			return
		case <-changed:
		}
	}
}

// sender writes messages to multireg, one JSON line each, from any goroutine.
type sender struct {
	mu sync.Mutex
	w  *bufio.Writer
}

func (s *sender) send(m nodecond.FromAgent) error {
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.w.Write(b)
	s.w.WriteByte('\n')
	return s.w.Flush()
}
