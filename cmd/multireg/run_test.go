package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// syncBuffer is a bytes.Buffer safe for the daemon's logger and the test to share.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func writeConfig(t *testing.T, dir, body string) string {
	t.Helper()
	p := filepath.Join(dir, "drivers.yaml")
	if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		<-tick.C
	}
}

func TestRunRegistersAndStops(t *testing.T) {
	dir, err := os.MkdirTemp("", "mr")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	reg := filepath.Join(dir, "reg")
	cfg := writeConfig(t, dir, `apiVersion: multireg.dev/v1alpha1
kind: RegistrarConfig
registrationDir: `+reg+`
defaults: {waitForEndpoint: false}
drivers:
  - {name: vendor.example/gpu, type: DevicePlugin, endpoint: /run/gpu/dp.sock}
  - {name: gpu.example.com, type: DRAPlugin, endpoint: /run/gpu/dra.sock}
`)
	for _, cleanup := range []bool{false, true} {
		ctx, cancel := context.WithCancel(context.Background())
		var logs syncBuffer
		done := make(chan error, 1)
		args := []string{"run", "--config", cfg, "--log-format", "json"}
		if cleanup {
			args = append(args, "--cleanup-on-exit")
		}
		go func() { done <- run(ctx, args, &logs, &logs) }()
		socks := []string{filepath.Join(reg, "vendor.example_gpu-reg.sock"), filepath.Join(reg, "gpu.example.com-reg.sock")}
		// The first run leaves its sockets; wait for this run's own.
		before := map[string]os.FileInfo{}
		for _, s := range socks {
			if fi, err := os.Lstat(s); err == nil {
				before[s] = fi
			}
		}
		waitFor(t, "both sockets published by this run", func() bool {
			for _, s := range socks {
				fi, err := os.Lstat(s)
				if err != nil || fi.Mode().Type() != os.ModeSocket || (before[s] != nil && os.SameFile(fi, before[s])) {
					return false
				}
			}
			return true
		})
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("run returned %v", err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("run did not stop within 5s")
		}
		for _, s := range socks {
			_, err := os.Lstat(s)
			if cleanup != os.IsNotExist(err) {
				t.Errorf("cleanup %v: socket %s: %v", cleanup, s, err)
			}
		}
		if !strings.Contains(logs.String(), `"msg":"multireg started"`) {
			t.Errorf("no JSON start line in the logs:\n%s", logs.String())
		}
	}
}

func TestRunRefusesInvalidConfig(t *testing.T) {
	cfg := writeConfig(t, t.TempDir(), "apiVersion: multireg.dev/v1alpha1\nkind: RegistrarConfig\ndrivers:\n  - name: x\n")
	err := run(context.Background(), []string{"run", "--config", cfg}, &bytes.Buffer{}, &bytes.Buffer{})
	if err == nil || exitCode(err) != 1 {
		t.Fatalf("run with an invalid config: %v, want exit 1", err)
	}
	for _, want := range []string{"drivers[0].type: required", "drivers[0].endpoint: required"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q lacks %q", err, want)
		}
	}
	if err := run(context.Background(), []string{"run", "--config", cfg, "--log-format", "xml"}, &bytes.Buffer{}, &bytes.Buffer{}); exitCode(err) != 2 {
		t.Errorf("--log-format xml: %v, want a usage error", err)
	}
}
