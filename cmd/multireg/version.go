package main

import (
	"fmt"
	"io"
	"runtime"
)

// Set at build time: go build -ldflags "-X main.version=v0.1.0 -X main.commit=abc123".
var (
	version = "devel"
	commit  = "unknown"
)

func runVersion(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("version", stderr)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "multireg %s (commit %s, %s, %s/%s)\n", version, commit, runtime.Version(), runtime.GOOS, runtime.GOARCH)
	return nil
}
