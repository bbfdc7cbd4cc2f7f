package registrar

import (
	"fmt"
	"log/slog"
	"path/filepath"
	"testing"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/testkit"
)

// BenchmarkHandOver measures one hand-over of n registered drivers, a third of each type:
// from the new instance asking until its loops serve every socket handed over and say
// Registered. Each iteration hands over to a new instance, the last one's successor.
func BenchmarkHandOver(b *testing.B) {
	for _, n := range []int{10, 100, 1000} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			log := slog.New(slog.DiscardHandler)
			dir := testkit.ShortDir(b)
			reg := filepath.Join(dir, "reg")
			types := []string{config.CSIPlugin, config.DevicePlugin, config.DRAPlugin}
			var ds []config.Driver
			for i := range n {
				typ := types[i%3]
				name := fmt.Sprintf("d%d.example.com", i)
				if typ == config.DevicePlugin {
					name = fmt.Sprintf("example.com/d%d", i)
				}
				d := testDriver(dir, name, typ, filepath.Join(dir, "ep", fmt.Sprintf("%d.sock", i)))
				csiName := ""
				if typ == config.CSIPlugin {
					csiName = d.Name
				}
				startEndpoint(b, d.LocalEndpoint, csiName)
				ds = append(ds, d)
			}
			holder := startMultiregLog(b, reg, ds, log)
			for _, d := range ds {
				awaitSocket(b, d)
				register(b, d.SocketPath, true, "")
			}
			allRegistered := func(s *Supervisor) bool {
				for _, st := range s.Status() {
					if st.Phase != Registered {
						return false
					}
				}
				return len(s.Status()) == n
			}
			testkit.Eventually(b, time.Minute, "every driver Registered", func() bool { return allRegistered(holder.sup) })

			b.ResetTimer()
			for range b.N {
				next := startMultiregLog(b, reg, ds, log)
				testkit.Eventually(b, time.Minute, "every driver Registered in the new instance", func() bool { return allRegistered(next.sup) })
				b.StopTimer()
				if next.sup.TakenOver() != n {
					b.Fatalf("%d sockets taken over, want %d", next.sup.TakenOver(), n)
				}
				holder.handedOver(b)
				holder = next
				b.StartTimer()
			}
		})
	}
}
