// Command endpoints serves fake plugin endpoints (package plugins) in a process of their own, so
// that a benchmark of multireg does not count them in multireg's figures nor in its own.
//
// Usage:
//
//	endpoints -list FILE               # one endpoint a line: PATH TYPE NAME (whitespace-separated)
//	endpoints -e PATH,TYPE,NAME ...    # or on the command line, repeatable
//
// TYPE is CSIPlugin, DRAPlugin or DevicePlugin; a CSI endpoint answers GetPluginInfo with NAME.
// Lines that are empty or start with # are skipped. Once every endpoint listens, it prints
// "ready N" on stdout. It serves until SIGTERM or SIGINT, or until its standard input reaches
// end of file when started with -stdin-eof (so that it ends with the parent that holds the
// pipe), then stops every endpoint, removes their sockets and exits 0.
package main

import (
	"bufio"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"multireg.dev/multireg/e2e/plugins"
)

type spec struct{ path, typ, name string }

type specList []spec

func (l *specList) String() string { return fmt.Sprint(len(*l), " endpoints") }

func (l *specList) Set(v string) error {
	parts := strings.Split(v, ",")
	if len(parts) != 3 {
		return fmt.Errorf("%q: want PATH,TYPE,NAME", v)
	}
	s, err := newSpec(parts[0], parts[1], parts[2])
	if err != nil {
		return err
	}
	*l = append(*l, s)
	return nil
}

func newSpec(path, typ, name string) (spec, error) {
	switch typ {
	case "CSIPlugin", "DRAPlugin", "DevicePlugin":
	default:
		return spec{}, fmt.Errorf("%s: unknown type %q", path, typ)
	}
	if !strings.HasPrefix(path, "/") || name == "" {
		return spec{}, fmt.Errorf("%q %q: want an absolute path and a name", path, name)
	}
	return spec{path: path, typ: typ, name: name}, nil
}

func main() {
	var specs specList
	list := flag.String("list", "", "file with one endpoint a line: PATH TYPE NAME")
	flag.Var(&specs, "e", "an endpoint as PATH,TYPE,NAME (repeatable)")
	stdinEOF := flag.Bool("stdin-eof", false, "also stop when standard input reaches end of file")
	flag.Parse()
	if err := run(specs, *list, *stdinEOF); err != nil {
		fmt.Fprintln(os.Stderr, "endpoints:", err)
		os.Exit(1)
	}
}

func run(specs specList, list string, stdinEOF bool) error {
	if list != "" {
		more, err := readList(list)
		if err != nil {
			return err
		}
		specs = append(specs, more...)
	}
	if len(specs) == 0 {
		return errors.New("no endpoint given (-list or -e)")
	}

	// Signals first: a parent may send SIGTERM as soon as it has seen "ready".
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	defer signal.Stop(sig)

	eps := make([]*plugins.Endpoint, 0, len(specs))
	defer func() {
		for _, ep := range eps {
			ep.Stop()
		}
	}()
	for _, s := range specs {
		ep, err := plugins.Start(s.path, s.typ, s.name)
		if err != nil {
			return err
		}
		eps = append(eps, ep)
	}
	fmt.Printf("ready %d\n", len(eps))

	eof := make(chan struct{})
	if stdinEOF {
		// This goroutine ends with the process: a read of stdin cannot be interrupted.
		go func() {
			_, _ = io.Copy(io.Discard, os.Stdin)
			close(eof)
		}()
	}
	select {
	case <-sig:
	case <-eof:
	}
	return nil
}

func readList(path string) ([]spec, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var specs []spec
	sc := bufio.NewScanner(f)
	for line := 1; sc.Scan(); line++ {
		text := strings.TrimSpace(sc.Text())
		if text == "" || strings.HasPrefix(text, "#") {
			continue
		}
		fields := strings.Fields(text)
		if len(fields) != 3 {
			return nil, fmt.Errorf("%s:%d: want PATH TYPE NAME, got %q", path, line, text)
		}
		s, err := newSpec(fields[0], fields[1], fields[2])
		if err != nil {
			return nil, fmt.Errorf("%s:%d: %w", path, line, err)
		}
		specs = append(specs, s)
	}
	return specs, sc.Err()
}
