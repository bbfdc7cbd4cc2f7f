// Command multireg registers every kubelet plugin on a node from one drivers file.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
)

func main() {
	if err := run(context.Background(), os.Args[1:], os.Stdin, os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(exitCode(err))
	}
}

// usageError is a command line that cannot be run; it exits 2.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error {
	return &usageError{msg: fmt.Sprintf(format, args...)}
}

func exitCode(err error) int {
	var u *usageError
	if errors.As(err, &u) {
		return 2
	}
	return 1
}

const usage = `multireg registers every kubelet plugin of a node (CSI drivers, DRA drivers, device
plugins) with kubelet, from one drivers file.

Usage:
  multireg <command> [flags]

Commands:
  run --config FILE        register every driver of the file with kubelet, until SIGTERM (Linux)
  validate --config FILE   check a drivers file, a ConfigMap, or rendered manifests (-f - reads stdin)
  status [-o table|json|yaml]
                           print the running daemon's per-driver state
  version [-o json|yaml]   print version, commit and Go version
  help [command]           print this help, or a command's

Run 'multireg <command> --help' (or 'multireg help <command>') for a command's flags.`

// commands are the subcommands; help <name> prints each one's help without running it.
var commands = map[string]func(ctx context.Context, args []string, std stdio, helpOnly bool) error{
	"run":      runDaemon,
	"validate": runValidate,
	"status":   runStatus,
	"version":  runVersion,
}

// stdio are a command's standard input, output and error.
type stdio struct {
	in       io.Reader
	out, err io.Writer
}

// run is the whole program: it picks the subcommand and returns its error. A nil stdin reads
// as empty.
func run(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) error {
	if stdin == nil {
		stdin = strings.NewReader("")
	}
	err := runCommand(ctx, args, stdio{stdin, stdout, stderr})
	if errors.Is(err, errHelp) {
		return nil
	}
	return err
}

func runCommand(ctx context.Context, args []string, std stdio) error {
	if len(args) == 0 {
		return usagef("%s", usage)
	}
	cmd, rest := args[0], args[1:]
	switch cmd {
	case "--version", "-version":
		cmd = "version"
	case "help", "-h", "--help", "-help":
		if cmd == "help" && len(rest) > 0 {
			c, ok := commands[rest[0]]
			if !ok || len(rest) > 1 {
				return usagef("multireg help: unknown command %q\nRun 'multireg --help' for usage.", strings.Join(rest, " "))
			}
			return c(ctx, nil, std, true)
		}
		fmt.Fprintln(std.out, usage)
		return nil
	}
	c, ok := commands[cmd]
	if !ok {
		return usagef("multireg: unknown command %q\nRun 'multireg --help' for usage.", cmd)
	}
	return c(ctx, rest, std, false)
}

// parseOrHelp parses a command's flags, or, when only its help is wanted, prints it.
func parseOrHelp(c *command, args []string, stdout io.Writer, helpOnly bool) error {
	if helpOnly {
		c.help(stdout)
		return errHelp
	}
	return c.parse(args, stdout)
}
