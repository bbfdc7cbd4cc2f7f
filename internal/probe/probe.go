// Package probe asks a driver's endpoint what multireg needs to know before and after
// kubelet registers it: whether it answers, a CSI driver's name and NodeGetInfo, and the
// DRAResourceHealth services a DRA driver serves. Each call has its own timeout.
package probe

import (
	"context"
	"errors"
	"fmt"
	"syscall"
	"time"

	csi "github.com/container-storage-interface/spec/lib/go/csi"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/sockfile"
)

// Timeout bounds one endpoint probe: a hung endpoint is not ready.
const Timeout = 2 * time.Second

// MaxInFlight bounds the calls to drivers' endpoints in flight at once, across every loop of a
// supervisor: each holds a gRPC client, its connection and its buffers, and 1000 drivers
// probed at once at start-up cost tens of MiB for a moment that the runtime gives back only
// slowly. A call's own timeout starts once it is in flight, so that a hung endpoint holds one
// place for at most Timeout and delays no other driver for longer.
const MaxInFlight = 32

// MaxHealthWaits bounds the questions of device health services in flight at once
// (HealthServices), across every loop of a supervisor, apart from MaxInFlight: such a question
// waits for the driver's answer for up to Timeout, and a driver that never answers must not
// hold a place the other drivers' probes wait for. Each costs a connection and about 40 KiB
// while it waits; the bound keeps a burst of DRA drivers that all say nothing under 20 MiB.
const MaxHealthWaits = 512

// InFlight bounds a supervisor's endpoint calls in flight (MaxInFlight places); nil: no bound.
type InFlight chan struct{}

// Do runs call once a place is free, or returns ctx's error when ctx ends first.
func (s InFlight) Do(ctx context.Context, call func() error) error {
	if s == nil {
		return call()
	}
	select {
	case s <- struct{}{}:
	case <-ctx.Done():
		return ctx.Err()
	}
	defer func() { <-s }()
	// On a goroutine of its own, which ends with it: a call's deep stack (gRPC's client) would
	// otherwise stay with the loop's goroutine, which lives as long as its driver.
	done := make(chan error, 1)
	go func() { done <- call() }()
	return <-done
}

// NameMismatchError is a CSI driver that answers under another name than the configured one.
type NameMismatchError struct {
	endpoint, got, want string
}

func (e *NameMismatchError) Error() string {
	return fmt.Sprintf("the CSI driver at %s reports the name %q, but the config names it %q", e.endpoint, e.got, e.want)
}

// Endpoint checks that the driver's endpoint accepts a unix connection and, for a CSI
// driver, that its Identity service reports the configured name.
func Endpoint(ctx context.Context, d config.Driver) error {
	ctx, cancel := context.WithTimeout(ctx, Timeout)
	defer cancel()
	c, err := sockfile.Dial(ctx, d.LocalEndpoint)
	if err != nil {
		return fmt.Errorf("endpoint %s does not accept connections: %w", d.LocalEndpoint, sysErr(err))
	}
	c.Close()
	if d.Type != config.CSIPlugin {
		return nil
	}
	conn, err := sockfile.Client(d.LocalEndpoint)
	if err != nil {
		return fmt.Errorf("endpoint %s: %w", d.LocalEndpoint, err)
	}
	defer conn.Close()
	info, err := csi.NewIdentityClient(conn).GetPluginInfo(ctx, &csi.GetPluginInfoRequest{})
	if err != nil {
		return fmt.Errorf("CSI GetPluginInfo on %s: %w", d.LocalEndpoint, err)
	}
	if info.GetName() != d.Name {
		return &NameMismatchError{endpoint: d.LocalEndpoint, got: info.GetName(), want: d.Name}
	}
	return nil
}

// sysErr shortens a dial error to its cause ("connection refused", "no such file or
// directory"), or a timeout.
func sysErr(err error) error {
	var errno syscall.Errno
	if errors.As(err, &errno) {
		return errno
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("no answer within %s", Timeout)
	}
	return err
}
