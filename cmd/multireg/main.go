// Command multireg registers every kubelet plugin on a node from one drivers file.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
)

func main() {
	if err := run(context.Background(), os.Args[1:], os.Stdout, os.Stderr); err != nil {
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

const usage = `usage: multireg <command> [flags]

commands:
  run --config FILE        register every driver of the file with kubelet, until SIGTERM
  validate --config FILE   parse and validate a drivers file
  status [-o table|json]   print the running daemon's per-driver state
  version                  print version, commit and Go version

Run "multireg <command> -h" for a command's flags.`

// run is the whole program: it picks the subcommand and returns its error.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	err := runCommand(ctx, args, stdout, stderr)
	if errors.Is(err, errHelp) {
		return nil
	}
	return err
}

func runCommand(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		return usagef("%s", usage)
	}
	switch cmd, rest := args[0], args[1:]; cmd {
	case "run":
		return runDaemon(ctx, rest, stderr)
	case "validate":
		return runValidate(rest, stdout, stderr)
	case "status":
		return runStatus(ctx, rest, stdout, stderr)
	case "version", "--version", "-version":
		return runVersion(rest, stdout, stderr)
	case "help", "-h", "--help":
		fmt.Fprintln(stdout, usage)
		return nil
	default:
		return usagef("multireg: unknown command %q\n%s", cmd, usage)
	}
}
