package registrar

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/regserver"
	"multireg.dev/multireg/internal/testkit"
)

// TestDriversBeyondTheDescriptorBudgetSayWhy: with RLIMIT_NOFILE leaving room for about 3
// registration sockets, that many drivers are served and registered, 2 more say why in their
// lastError, the supervisor's Descriptors says what does not fit, and the log warns once;
// the sockets never take the descriptors kept for the rest (HTTP, the config, probes,
// kubelet's connections).
func TestDriversBeyondTheDescriptorBudgetSayWhy(t *testing.T) {
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil {
		t.Fatal(err)
	}
	// What the hub will keep for the rest: the descriptors open now, and its spares.
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	low := rl
	low.Cur = uint64(len(fds)-1+regserver.SpareFDs+regserver.KubeletFDs) + 3
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &low); err != nil {
		t.Fatal(err)
	}
	logs := &testkit.Buffer{}
	s, err := New(Options{Log: logs.Logger()})
	// The supervisor read the limit; the test's own descriptors are not counted against it.
	if rerr := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &rl); rerr != nil {
		t.Fatal(rerr)
	}
	if err != nil {
		t.Fatal(err)
	}
	testkit.RunUntilEnd(t, func(ctx context.Context) { s.Run(ctx) })
	room := s.Descriptors().MaxSockets // 3, give or take the descriptors the runtime opened
	if room < 1 || room > 5 {
		t.Fatalf("room for %d sockets, want about 3", room)
	}
	dir := testkit.ShortDir(t)
	var ds []config.Driver
	for i := range room + 2 {
		ep := filepath.Join(dir, "ep", fmt.Sprintf("d%d.sock", i))
		startEndpoint(t, ep, fmt.Sprintf("d%d.csi.k8s.io", i))
		d := testDriver(dir, fmt.Sprintf("d%d.csi.k8s.io", i), config.CSIPlugin, ep)
		ds = append(ds, d)
		s.Start(d)
	}
	var unfit []string
	testkit.Eventually(t, 10*time.Second, "the drivers that fit served, 2 saying the descriptors do not fit", func() bool {
		unfit = unfit[:0]
		served := 0
		for _, d := range ds {
			st := statusOf(s, d.Name)
			switch {
			case st.Phase == Serving:
				served++
			case strings.Contains(st.LastError, "no file descriptor left for the registration socket "+d.SocketPath) &&
				strings.Contains(st.LastError, fmt.Sprintf("RLIMIT_NOFILE is %d", low.Cur)):
				unfit = append(unfit, d.Name)
			}
		}
		return served == room && len(unfit) == 2
	})
	for _, d := range ds {
		if st := statusOf(s, d.Name); st.Phase == Serving {
			registerAndWait(t, s, d)
		}
	}
	got := s.Descriptors()
	if got.Fits() || got.Needed != room+2 || got.MaxSockets != room || got.Sockets != room || got.Limit != int(low.Cur) {
		t.Errorf("Descriptors = %+v, want %d needed, room for %d, all taken", got, room+2, room)
	}
	if p := got.Problem(); !strings.Contains(p, fmt.Sprintf("the %d drivers need %d registration sockets", room+2, room+2)) || !strings.Contains(p, "2 drivers get no socket") {
		t.Errorf("Problem() = %q", p)
	}
	if n := strings.Count(logs.String(), "not every driver's registration socket fits"); n != 1 {
		t.Errorf("%d warnings that the sockets do not fit, want 1:\n%s", n, logs.String())
	}
	s.Stop(ds[0].Name)
	s.Stop(ds[1].Name)
	if got := s.Descriptors(); !got.Fits() || got.Problem() != "" {
		t.Errorf("with %d drivers, Descriptors = %+v, problem %q, want them to fit", room, got, got.Problem())
	}
}
