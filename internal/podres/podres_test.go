package podres_test

import (
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"multireg.dev/multireg/internal/podres"
	"multireg.dev/multireg/internal/testkit"
)

func TestSocketPath(t *testing.T) {
	for give, want := range map[string]string{
		"/var/lib/kubelet/plugins_registry":     "/var/lib/kubelet/pod-resources/kubelet.sock",
		"/var/lib/k0s/kubelet/plugins_registry": "/var/lib/k0s/kubelet/pod-resources/kubelet.sock",
		"/var/lib/kubelet/plugins_registry/":    "/var/lib/kubelet/pod-resources/kubelet.sock",
	} {
		if got := podres.SocketPath(give); got != want {
			t.Errorf("SocketPath(%q) = %q, want %q", give, got, want)
		}
	}
}

// TestViewReadsKubelet: the view reads kubelet's allocatable devices per resource, says since
// when each count holds, wakes its waiters on a change only, and reads quickly when asked.
func TestViewReadsKubelet(t *testing.T) {
	sock := filepath.Join(testkit.ShortDir(t), "kubelet.sock")
	k := testkit.StartPodResources(t, sock)
	k.Set("example.com/gpu", 2)
	var log testkit.Buffer
	v := podres.New(sock, log.Logger())
	testkit.RunUntilEnd(t, v.Run)
	testkit.Eventually(t, 5*time.Second, "kubelet read", v.Available)
	r, _ := v.Last()
	if n, since, ok := r.Count("example.com/gpu"); !ok || n != 2 || since.IsZero() || since.After(r.At) {
		t.Errorf("Count(gpu) = %d, %v, %v; want 2 since the first read", n, since, ok)
	}
	if n, since, ok := r.Count("example.com/none"); !ok || n != 0 || !since.Equal(r.At) {
		t.Errorf("Count(none) = %d, %v, %v; want 0 since the first read %v", n, since, ok, r.At)
	}

	changed := v.Changed()
	k.Set("example.com/gpu", 0)
	v.Quick(time.Second)
	select {
	case <-changed:
	case <-time.After(5 * time.Second):
		t.Fatal("no change seen after the resource's devices went")
	}
	r2, _ := v.Last()
	if n, since, _ := r2.Count("example.com/gpu"); n != 0 || !since.After(r.At) {
		t.Errorf("after the drop: %d since %v, want 0 since a read after %v", n, since, r.At)
	}
	// An unchanged reading wakes no one; quick reads go on meanwhile: three within less than
	// the two reads a second of the usual pace.
	calls := k.Calls()
	quiet := v.Changed()
	v.Quick(2 * podres.Period)
	testkit.Eventually(t, 2*podres.Period-100*time.Millisecond, "three quick reads", func() bool { return k.Calls()-calls >= 3 })
	select {
	case <-quiet:
		t.Error("a change seen without one")
	default:
	}
}

// TestViewWithoutKubelet: no socket is said once, not at every read, and a kubelet that comes
// later is read.
func TestViewWithoutKubelet(t *testing.T) {
	sock := filepath.Join(testkit.ShortDir(t), "kubelet.sock")
	var log testkit.Buffer
	v := podres.New(sock, log.Logger())
	testkit.RunUntilEnd(t, v.Run)
	testkit.Eventually(t, 5*time.Second, "the absence logged", func() bool { return strings.Contains(log.String(), "does not answer") })
	v.Quick(300 * time.Millisecond)
	testkit.Never(t, 400*time.Millisecond, "the absence logged again", func() bool { return strings.Count(log.String(), "does not answer") > 1 })
	if v.Available() {
		t.Error("available without a socket")
	}
	k := testkit.StartPodResources(t, sock)
	k.Set("example.com/gpu", 1)
	testkit.Eventually(t, 5*time.Second, "kubelet read once it serves", v.Available)
	if !strings.Contains(log.String(), "answers") {
		t.Errorf("the arrival not logged:\n%s", log.String())
	}
	var nilView *podres.View
	if nilView.Available() || nilView.Changed() != nil {
		t.Error("a nil view reads something")
	}
}

// TestViewToleratesATransientError: a read kubelet refuses (its rate limit for every client of
// the node: ResourceExhausted), or two, on the same socket, leave the view up and in the same
// run of kubelet; a kubelet that stops is down, and one that starts again, on a socket of its
// own, is another run.
func TestViewToleratesATransientError(t *testing.T) {
	sock := filepath.Join(testkit.ShortDir(t), "kubelet.sock")
	k := testkit.StartPodResources(t, sock)
	k.Set("example.com/gpu", 2)
	var log testkit.Buffer
	v := podres.New(sock, log.Logger())
	testkit.RunUntilEnd(t, v.Run)
	testkit.Eventually(t, 5*time.Second, "kubelet read", v.Available)
	_, _, run := v.State()
	calls := k.Calls()
	k.FailNext(status.Error(codes.ResourceExhausted, "rejected by rate limit"), status.Error(codes.ResourceExhausted, "rejected by rate limit"))
	v.Quick(time.Second)
	testkit.Eventually(t, 5*time.Second, "two refused reads and one answered", func() bool { return k.Calls()-calls >= 3 })
	testkit.Eventually(t, 5*time.Second, "an answered read", func() bool {
		r, _ := v.Last()
		return r.At.After(time.Now().Add(-podres.Period))
	})
	if _, up, now := v.State(); !up || now != run {
		t.Errorf("after two refused reads: up %v, run %d; want up, run %d", up, now, run)
	}
	if strings.Contains(log.String(), "does not answer") {
		t.Error("a refused read taken for kubelet's API down")
	}
	k.Stop()
	testkit.Eventually(t, 5*time.Second, "down once kubelet stopped", func() bool { return !v.Available() })
	k2 := testkit.StartPodResources(t, sock)
	k2.Set("example.com/gpu", 2)
	testkit.Eventually(t, 5*time.Second, "up again", v.Available)
	if _, _, now := v.State(); now != run+1 {
		t.Errorf("run %d after kubelet's restart, want %d", now, run+1)
	}
}
