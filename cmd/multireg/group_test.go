//go:build linux

package main

import (
	"errors"
	"slices"
	"sync"
	"testing"
)

// TestGroupStopsInReverseOrder: the first actor to return stops the others, the last added
// first, each only once those added after it have returned; every interrupt gets the first
// actor's error, and run returns every error, the first one first.
func TestGroupStopsInReverseOrder(t *testing.T) {
	var mu sync.Mutex
	var order []string
	note := func(s string) {
		mu.Lock()
		defer mu.Unlock()
		order = append(order, s)
	}
	fatal := errors.New("the reloader failed")
	errLate := errors.New("the HTTP server failed while stopping")
	var g group
	blocking := func(name string, ret error) {
		stop := make(chan error)
		g.add(func() error {
			got := <-stop
			if got != fatal {
				t.Errorf("%s interrupted with %v, want the first actor's error", name, got)
			}
			note(name + " returned")
			return ret
		}, func(err error) {
			note(name + " interrupted")
			stop <- err
		})
	}
	blocking("http", errLate)
	blocking("supervisor", nil)
	g.add(func() error { return fatal }, func(error) { t.Error("the actor that returned was interrupted") })
	blocking("signals", nil)

	err := g.run()
	want := []string{
		"signals interrupted", "signals returned",
		"supervisor interrupted", "supervisor returned",
		"http interrupted", "http returned",
	}
	if !slices.Equal(order, want) {
		t.Errorf("stop order %q, want %q", order, want)
	}
	if !errors.Is(err, fatal) || !errors.Is(err, errLate) {
		t.Errorf("run: %v, want both errors", err)
	}
	if first := err.(interface{ Unwrap() []error }).Unwrap()[0]; first != fatal {
		t.Errorf("first error %v, want %v", first, fatal)
	}
}
