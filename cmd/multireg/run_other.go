//go:build !linux

package main

import (
	"context"
	"runtime"
)

// runDaemon is `multireg run` where it cannot run: kubelet's plugin registration, the
// hand-over's descriptor passing and the lock are Linux's. Its help still answers.
func runDaemon(_ context.Context, args []string, std stdio, helpOnly bool) error {
	if _, err := parseRunFlags(args, std.out, helpOnly); err != nil {
		return err
	}
	return usagef("multireg run: the daemon runs on Linux only, not on %s/%s; validate, status and version run anywhere", runtime.GOOS, runtime.GOARCH)
}
