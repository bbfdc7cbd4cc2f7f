// Command pause is the sandbox process of the e2e cluster's pods. It holds the pod's
// namespaces open until SIGINT or SIGTERM and then exits 0. As the sandbox's PID 1 it inherits
// every orphan in the pod's PID namespace, so it reaps them on SIGCHLD.
//
// It uses only the standard library and is built static (CGO_ENABLED=0) by images.BuildPause.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	// Buffered so that signals arriving while we reap are not lost; SIGCHLDs may still
	// coalesce, which reap tolerates by collecting every exited child at once.
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range sigs {
		if sig != syscall.SIGCHLD {
			return
		}
		reap()
	}
}

// reap collects every child that has exited, without blocking. It returns when no exited
// child is left (or there are no children at all).
func reap() {
	for {
		var ws syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
		if err == syscall.EINTR {
			continue
		}
		if err != nil || pid <= 0 {
			return
		}
	}
}
