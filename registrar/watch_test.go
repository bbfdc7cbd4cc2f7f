package registrar

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/testkit"
)

// watchesFor reports whether the supervisor's watcher watches dir for the file, or the missing
// directory, name.
func watchesFor(s *Supervisor, dir, name string) bool { return s.env.w.Watches(dir, name) }

// TestDriverAtTheWatchLimit: with no inotify watch at all, a driver waits for its endpoint
// (whose directory exists or not) without probing before its backoff ends, is published as
// soon as a look finds the endpoint, and a look sees the endpoint restart and the socket
// removed.
func TestDriverAtTheWatchLimit(t *testing.T) {
	if !testkit.AtWatchLimit(t, 0) {
		return
	}
	for _, dirExists := range []bool{false, true} {
		t.Run(fmt.Sprintf("endpoint directory exists=%v", dirExists), func(t *testing.T) {
			s, d := setupWaiting(t, config.DevicePlugin, func(d *config.Driver) {
				if dirExists {
					if err := os.Mkdir(filepath.Dir(d.LocalEndpoint), 0o755); err != nil {
						t.Fatal(err)
					}
				}
				d.Backoff.InitialInterval = time.Minute
				d.Backoff.MaxInterval = time.Minute
			})
			probeInAMinute := func() bool {
				st := statusOf(s, d.Name)
				return st.Phase == WaitingForEndpoint && time.Until(st.NextAttempt) > 30*time.Second
			}
			testkit.Eventually(t, 5*time.Second, "the first probe failed, the next in a minute", probeInAMinute)
			testkit.Never(t, 1500*time.Millisecond, "a probe before the backoff ended, with nothing at the endpoint", func() bool { return !probeInAMinute() })

			e := startEndpoint(t, d.LocalEndpoint, "")
			awaitSocket(t, d)
			registerAndWait(t, s, d)
			first := mustID(t, d.SocketPath)
			e.Stop()
			startEndpoint(t, d.LocalEndpoint, "")
			testkit.Eventually(t, 5*time.Second, "the socket recreated after the endpoint restarted", func() bool {
				id, _, err := fsid.Stat(d.SocketPath)
				return err == nil && id != first
			})
			second := mustID(t, d.SocketPath)
			if err := os.Remove(d.SocketPath); err != nil {
				t.Fatal(err)
			}
			testkit.Eventually(t, 5*time.Second, "the removed socket recreated", func() bool {
				id, _, err := fsid.Stat(d.SocketPath)
				return err == nil && id != second
			})
		})
	}
}
