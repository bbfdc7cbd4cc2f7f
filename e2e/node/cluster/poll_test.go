package cluster

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"
)

func TestPollEndsAtOnceWhenAComponentExited(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	start := time.Now()
	looks := 0
	err := poll(ctx, 10*time.Millisecond, "kubelet answering", func() (bool, error) {
		looks++
		if looks < 3 {
			return false, errors.New("connection refused") // not yet: polled again
		}
		return false, fmt.Errorf("%w: kubelet exited (exit status 1); last lines:\nbind: address already in use", errExited)
	})
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("poll returned after %s; want at once after the exit", d)
	}
	if !errors.Is(err, errExited) || !strings.Contains(err.Error(), "address already in use") || !strings.HasPrefix(err.Error(), "kubelet answering: ") {
		t.Errorf("poll = %v; want the exit, with the log's lines", err)
	}
	if looks != 3 {
		t.Errorf("cond called %d times; want 3 (two ordinary errors polled again, then the exit)", looks)
	}
	// Ordinary errors are still only the last reason at the deadline.
	short, cancel2 := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel2()
	err = poll(short, 10*time.Millisecond, "x", func() (bool, error) { return false, errors.New("not yet") })
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "not yet") {
		t.Errorf("poll = %v; want the deadline with the last reason", err)
	}
}

func TestFreePortBelowTheEphemeralRange(t *testing.T) {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		t.Skip("no /proc/sys/net/ipv4/ip_local_port_range")
	}
	low, err := strconv.Atoi(strings.Fields(string(b))[0])
	if err != nil || low <= 20000 {
		t.Skipf("ephemeral range %q starts at or below 20000", strings.TrimSpace(string(b)))
	}
	for range 20 {
		port, err := FreePort()
		if err != nil {
			t.Fatal(err)
		}
		if port < 20000 || port >= low {
			t.Errorf("FreePort = %d; want in [20000, %d)", port, low)
		}
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		if err != nil {
			t.Errorf("FreePort = %d, not free: %v", port, err)
			continue
		}
		l.Close()
	}
}
