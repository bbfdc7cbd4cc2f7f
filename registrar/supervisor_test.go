package registrar

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"multireg.dev/multireg/config"
)

// inotifyInstances counts this process's inotify file descriptors.
func inotifyInstances(t *testing.T) int {
	t.Helper()
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, fd := range fds {
		if target, err := os.Readlink(filepath.Join("/proc/self/fd", fd.Name())); err == nil && target == "anon_inode:inotify" {
			n++
		}
	}
	return n
}

// TestManyDriversShareOneWatcher runs more drivers than Linux's default limit of 128 inotify
// instances per user: they must share one.
func TestManyDriversShareOneWatcher(t *testing.T) {
	dir := shortDir(t)
	before := inotifyInstances(t)
	s := runSupervisor(t, Options{})
	const n = 150
	var drivers []config.Driver
	for i := range n {
		d := testDriver(dir, fmt.Sprintf("vendor.example/dev%d", i), config.DevicePlugin, filepath.Join(dir, "ep", fmt.Sprintf("d%d.sock", i)))
		d.WaitForEndpoint = false
		drivers = append(drivers, d)
		s.Start(d)
	}
	eventually(t, 30*time.Second, "every socket", func() bool {
		for _, d := range drivers {
			if !isSocket(d.SocketPath) {
				return false
			}
		}
		return true
	})
	if got := inotifyInstances(t) - before; got != 1 {
		t.Errorf("%d drivers use %d inotify instances, want 1", n, got)
	}
	if got := len(s.Status()); got != n {
		t.Errorf("status lists %d drivers, want %d", got, n)
	}
}

// TestHungEndpointDoesNotDelayOthers: a CSI endpoint that accepts connections but never
// answers keeps only its own driver waiting.
func TestHungEndpointDoesNotDelayOthers(t *testing.T) {
	dir := shortDir(t)
	hungPath := filepath.Join(dir, "hung", "csi.sock")
	if err := os.MkdirAll(filepath.Dir(hungPath), 0o755); err != nil {
		t.Fatal(err)
	}
	hung, err := net.Listen("unix", hungPath) // never accepts: the kernel completes connects, nobody answers
	if err != nil {
		t.Fatal(err)
	}
	defer hung.Close()
	hd := testDriver(dir, "hung.csi.k8s.io", config.CSIPlugin, hungPath)

	ep := filepath.Join(dir, "ep", "csi.sock")
	startEndpoint(t, ep, "nfs.csi.k8s.io")
	ok := testDriver(dir, "nfs.csi.k8s.io", config.CSIPlugin, ep)

	s := runSupervisor(t, Options{})
	s.Start(hd)
	s.Start(ok)
	eventually(t, 5*time.Second, "the healthy driver's socket", func() bool { return isSocket(ok.SocketPath) })
	register(t, ok.SocketPath, true, "")
	eventually(t, 5*time.Second, "the healthy driver registered", func() bool { return statusOf(s, ok.Name).Phase == Registered })
	eventually(t, 5*time.Second, "the hung driver's probe to time out", func() bool {
		st := statusOf(s, hd.Name)
		return st.Phase == WaitingForEndpoint && strings.Contains(st.LastError, "GetPluginInfo")
	})
	if isSocket(hd.SocketPath) {
		t.Error("a socket was published for a hung endpoint")
	}
}
