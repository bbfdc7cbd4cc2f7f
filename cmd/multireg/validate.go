package main

import (
	"errors"
	"flag"
	"fmt"
	"io"

	"multireg.dev/multireg/config"
)

// newFlagSet returns a FlagSet that reports its errors as usage errors instead of exiting.
func newFlagSet(name string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet("multireg "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	return fs
}

// errHelp ends a command whose help was asked for and printed.
var errHelp = errors.New("help requested")

// parseFlags parses args and refuses positional arguments.
func parseFlags(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return errHelp
		}
		return usagef("%s: %v", fs.Name(), err)
	}
	if fs.NArg() > 0 {
		return usagef("%s: unexpected argument %q", fs.Name(), fs.Arg(0))
	}
	return nil
}

// runValidate parses and validates a drivers file. It prints a one-line summary and returns nil
// for a valid file; otherwise it returns every problem, one per line.
func runValidate(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("validate", stderr)
	path := fs.String("config", "", "path to the drivers file (required)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *path == "" {
		return usagef("multireg validate: --config is required")
	}
	cfg, err := config.Load(*path)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "%s: valid: %s\n", *path, cfg.Summary())
	return nil
}
