package registrar

import (
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/regdir"
	"multireg.dev/multireg/internal/testkit"
)

// TestGuardStopsPublish: a supervisor whose guard fails (the directory is another
// instance's) publishes nothing; its drivers back off with the guard's error and publish once
// it passes.
func TestGuardStopsPublish(t *testing.T) {
	dir := testkit.ShortDir(t)
	var lost atomic.Bool
	lost.Store(true)
	s := runSupervisor(t, Options{Guard: func() error {
		if lost.Load() {
			return regdir.ErrDirLost
		}
		return nil
	}})
	d := testDriver(dir, "vendor.example/gpu", config.DevicePlugin, filepath.Join(dir, "dp.sock"))
	d.WaitForEndpoint = false
	s.Start(d)
	testkit.Eventually(t, 5*time.Second, "the guard's error in the driver's status", func() bool {
		st := statusOf(s, d.Name)
		return st.Phase == BackingOff && strings.Contains(st.LastError, regdir.ErrDirLost.Error())
	})
	if _, err := os.Lstat(d.SocketPath); !os.IsNotExist(err) {
		t.Fatalf("a socket was published while the guard failed: %v", err)
	}
	lost.Store(false)
	awaitSocket(t, d)
}
