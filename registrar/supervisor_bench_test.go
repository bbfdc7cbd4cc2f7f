package registrar

import (
	"fmt"
	"log/slog"
	"path/filepath"
	"testing"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/testkit"
)

// BenchmarkStartStop measures the supervisor's part of a reload that adds a driver and
// removes it again: Start, then Stop, which returns once the loop has exited and removed its
// socket, with n other drivers running.
func BenchmarkStartStop(b *testing.B) {
	for _, n := range []int{10, 1000} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			dir := testkit.ShortDir(b)
			s := runSupervisor(b, Options{Log: slog.New(slog.DiscardHandler)})
			for i := range n {
				d := testDriver(dir, fmt.Sprintf("example.com/d%d", i), config.DevicePlugin, filepath.Join(dir, "ep", fmt.Sprintf("%d.sock", i)))
				s.Start(d) // waits for its endpoint, which never comes
			}
			d := testDriver(dir, "example.com/bench", config.DevicePlugin, filepath.Join(dir, "ep", "bench.sock"))
			d.WaitForEndpoint = false
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				s.Start(d)
				s.Stop(d.Name)
			}
		})
	}
}
