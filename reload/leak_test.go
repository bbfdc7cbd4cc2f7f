package reload_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strings"
	"testing"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/registrar"
	"multireg.dev/multireg/reload"
)

// resources counts what a leak would grow: goroutines, open file descriptors, and inotify
// watches.
type resources struct{ goroutines, fds, watches int }

// goroutineStacks is a dump of every goroutine, grouped by stack, for a failure report.
func goroutineStacks() string {
	var b strings.Builder
	_ = pprof.Lookup("goroutine").WriteTo(&b, 1)
	return b.String()
}

func measure(t *testing.T) resources {
	t.Helper()
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	r := resources{goroutines: runtime.NumGoroutine(), fds: len(fds)}
	for _, fd := range fds {
		b, err := os.ReadFile(filepath.Join("/proc/self/fdinfo", fd.Name()))
		if err == nil {
			r.watches += strings.Count(string(b), "inotify wd:")
		}
	}
	return r
}

// TestNoLeaksAcrossReloads reloads 200 times, each time restarting one of five drivers whose
// sockets are real, with the real supervisor and the file watch on. The drivers file is a
// symlink, pointed at each reload to a file in a new directory (the old ones stay), so the
// watch of the target's directory moves every time. The process ends with the goroutines, file
// descriptors and inotify watches it had after the first reload.
func TestNoLeaksAcrossReloads(t *testing.T) {
	dir, err := os.MkdirTemp("", "leak")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "drivers.yaml")
	// update writes the content into t<gen>/ and points the symlink at path there.
	update := func(gen int, content string) {
		t.Helper()
		target := filepath.Join(dir, fmt.Sprintf("t%d", gen), "drivers.yaml")
		if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(target, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(target, path+".tmp"); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(path+".tmp", path); err != nil {
			t.Fatal(err)
		}
	}
	content := func(gen int) string {
		var b strings.Builder
		fmt.Fprintf(&b, "apiVersion: multireg.dev/v1alpha1\nkind: RegistrarConfig\nregistrationDir: %s/reg\n", dir)
		b.WriteString("defaults: {waitForEndpoint: false}\ndrivers:\n")
		for i := range 5 {
			ep := fmt.Sprintf("/run/d%d.sock", i)
			if i == gen%5 {
				ep = fmt.Sprintf("/run/d%d-%d.sock", i, gen%2)
			}
			fmt.Fprintf(&b, "  - {name: example.com/d%d, type: DevicePlugin, endpoint: %s}\n", i, ep)
		}
		return b.String()
	}
	update(0, content(0))
	cfg, b, err := config.LoadContent(path)
	if err != nil {
		t.Fatal(err)
	}
	sup, err := registrar.New(registrar.Options{})
	if err != nil {
		t.Fatal(err)
	}
	rl := reload.New(reload.Options{Path: path, Initial: cfg, InitialContent: b, Apply: sup, Debounce: 5 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	rlDone, supDone := make(chan error, 1), make(chan error, 1)
	go func() { rlDone <- rl.Run(ctx) }()
	go func() { supDone <- sup.Run(ctx) }()
	defer func() {
		cancel()
		<-rlDone
		<-supDone
	}()

	reloadTo := func(gen int) {
		t.Helper()
		update(gen, content(gen))
		deadline := time.Now().Add(10 * time.Second)
		for rl.State().Generation != gen+1 || !allServing(sup) {
			if time.Now().After(deadline) {
				t.Fatalf("reload %d not applied: %+v", gen, rl.State())
			}
			time.Sleep(2 * time.Millisecond) // polling a condition with a deadline
		}
	}
	reloadTo(1)
	base := settled(t)
	baseStacks := goroutineStacks()
	for gen := 2; gen <= 201; gen++ {
		reloadTo(gen)
	}
	// Stopped goroutines take a moment to exit.
	deadline := time.Now().Add(10 * time.Second)
	for {
		got := measure(t)
		if got.goroutines <= base.goroutines && got.fds <= base.fds && got.watches <= base.watches {
			t.Logf("after 200 reloads: %+v (after the first: %+v)", got, base)
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 200 reloads: %+v, after the first: %+v\ngoroutines after the first reload:\n%s\ngoroutines now:\n%s",
				got, base, baseStacks, goroutineStacks())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func allServing(s *registrar.Supervisor) bool {
	st := s.Status()
	if len(st) != 5 {
		return false
	}
	for _, d := range st {
		if d.Phase != registrar.Serving || d.Attempts == 0 {
			return false
		}
		// A loop that does not wait for its endpoint is Serving from the start, and counts
		// its attempt before the socket appears: the socket must be there too.
		if fi, err := os.Lstat(d.Socket); err != nil || fi.Mode()&os.ModeSocket == 0 {
			return false
		}
	}
	return true
}

// settled measures once the figures stopped moving (three equal samples 20 ms apart): a
// loop whose socket just appeared starts its server's goroutine a moment later.
func settled(t *testing.T) resources {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	prev, same := measure(t), 0
	for same < 2 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond) // sampling: there is no event for "no goroutine starts"
		cur := measure(t)
		if cur == prev {
			same++
		} else {
			prev, same = cur, 0
		}
	}
	return prev
}
