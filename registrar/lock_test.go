package registrar

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestLockWaitsAndTakesOver(t *testing.T) {
	dir := filepath.Join(shortDir(t), "reg")
	var logs syncLog
	first, err := AcquireLock(context.Background(), dir, logs.logger())
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan *Lock, 1)
	go func() {
		l, err := AcquireLock(context.Background(), dir, logs.logger())
		if err != nil {
			t.Error(err)
		}
		got <- l
	}()
	eventually(t, 5*time.Second, "the second instance to say it waits", func() bool {
		return strings.Contains(logs.String(), "waiting for it to exit")
	})
	select {
	case <-got:
		t.Fatal("a second instance took a held lock")
	default:
	}
	first.Release()
	select {
	case l := <-got:
		l.Release()
	case <-time.After(5 * time.Second):
		t.Fatal("the second instance did not take over")
	}
	if !strings.Contains(logs.String(), "took over") {
		t.Errorf("no take-over line in:\n%s", logs.String())
	}

	// A waiting instance gives up when its context ends.
	held, err := AcquireLock(context.Background(), dir, logs.logger())
	if err != nil {
		t.Fatal(err)
	}
	defer held.Release()
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if _, err := AcquireLock(ctx, dir, logs.logger()); err != context.DeadlineExceeded {
		t.Errorf("AcquireLock with an ended context: %v", err)
	}
}

func TestLockRemovesOnlyOurTempSockets(t *testing.T) {
	dir := filepath.Join(shortDir(t), "reg")
	if err := os.MkdirAll(dir, 0o750); err != nil {
		t.Fatal(err)
	}
	mk := func(name string) string {
		p := filepath.Join(dir, name)
		l, err := listenUnlinked(p)
		if err != nil {
			t.Fatal(err)
		}
		l.Close()
		return p
	}
	ours := mk(".mr-0123abcd.tmp")
	theirs := mk(".other.tmp")
	plugin := mk("x-reg.sock")
	notSocket := filepath.Join(dir, ".mr-ffffffff.tmp")
	if err := os.WriteFile(notSocket, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	l, err := AcquireLock(context.Background(), dir, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release()
	if _, err := os.Lstat(ours); !os.IsNotExist(err) {
		t.Errorf("leftover temporary socket: %v, want removed", err)
	}
	for _, p := range []string{theirs, plugin, notSocket} {
		if _, err := os.Lstat(p); err != nil {
			t.Errorf("%s was touched: %v", p, err)
		}
	}
}
