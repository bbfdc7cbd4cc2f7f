//go:build linux

package main

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"multireg.dev/multireg/internal/testkit"
	"multireg.dev/multireg/registrar"
)

// TestReturnBurst: the start-up's memory is returned once no driver awaits kubelet and none
// changed phase for a while — not while one is Serving — and only once.
func TestReturnBurst(t *testing.T) {
	var mu sync.Mutex
	phase := registrar.Serving
	drivers := func() []registrar.DriverStatus {
		mu.Lock()
		defer mu.Unlock()
		return []registrar.DriverStatus{{Name: "a", Phase: phase}}
	}
	end := burstEnd{look: 10 * time.Millisecond, quiet: 50 * time.Millisecond, most: time.Minute}
	var logs testkit.Buffer
	log := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- returnBurst(ctx, drivers, end, log) }()

	const said = "start-up over"
	testkit.Never(t, 300*time.Millisecond, "the memory returned while a driver awaits kubelet", func() bool { return strings.Contains(logs.String(), said) })
	mu.Lock()
	phase = registrar.Registered
	mu.Unlock()
	testkit.Eventually(t, 5*time.Second, "the memory returned once the drivers are quiet", func() bool { return strings.Contains(logs.String(), said) })
	testkit.Never(t, 200*time.Millisecond, "the memory returned twice", func() bool { return strings.Count(logs.String(), said) > 1 })
	cancel()
	if err := <-done; err != nil {
		t.Errorf("returnBurst: %v", err)
	}
}
