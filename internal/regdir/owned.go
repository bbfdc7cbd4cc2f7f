package regdir

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/sockfile"
)

// OwnedName is the file in the registration directory that records which sockets multireg
// owns. A driver removed from the drivers file while multireg was not running (killed, or
// stopped and edited) leaves a socket nothing else would ever remove, and kubelet would keep
// the plugin registered; a restarted multireg removes the recorded sockets that are no longer
// configured. The leading dot makes kubelet ignore it.
const OwnedName = ".multireg.sockets"

// recordOwned records the socket file names multireg owns in dir, replacing the previous
// record in one step.
func recordOwned(dir string, names []string) error {
	names = slices.Sorted(slices.Values(names))
	var b bytes.Buffer
	b.WriteString("# Registration sockets owned by multireg; it removes those no longer configured.\n")
	for _, n := range names {
		b.WriteString(n + "\n")
	}
	tmp := filepath.Join(dir, OwnedName+".tmp")
	if err := os.WriteFile(tmp, b.Bytes(), 0o600); err != nil {
		return fmt.Errorf("record owned sockets: %w", err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, OwnedName)); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("record owned sockets: %w", err)
	}
	return nil
}

// removeOrphans removes the sockets recorded in dir whose names are not in keep, if nothing
// listens on them: sockets of drivers removed from the file while multireg did not run, or
// those a hand-over did not bring (a predecessor that handed over more than this instance
// accepts). A live socket (another registrar's) and anything that is not a socket stay. It
// returns the paths removed. It logs a line for each socket when few (perSocketLines), and one
// for all otherwise.
func removeOrphans(dir string, keep []string, log *slog.Logger) ([]string, error) {
	b, err := os.ReadFile(filepath.Join(dir, OwnedName))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read owned sockets: %w", err)
	}
	var removed []string
	type failure struct {
		path string
		err  error
	}
	var failed []failure
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		name := strings.TrimSpace(sc.Text())
		if name == "" || strings.HasPrefix(name, "#") || strings.ContainsRune(name, '/') || slices.Contains(keep, name) {
			continue
		}
		path := filepath.Join(dir, name)
		if _, mode, err := fsid.Stat(path); err != nil || mode&fs.ModeSocket == 0 {
			continue
		}
		if err := sockfile.RemoveStale(path); err != nil {
			failed = append(failed, failure{path, err})
			continue
		}
		if _, err := os.Lstat(path); errors.Is(err, fs.ErrNotExist) {
			removed = append(removed, path)
		}
	}
	if len(removed)+len(failed) <= perSocketLines {
		for _, f := range failed {
			log.Warn("remove the socket of a driver no longer configured", "socket", f.path, "err", f.err)
		}
		for _, path := range removed {
			log.Info("removed the socket of a driver no longer configured; kubelet deregisters it", "socket", path)
		}
		return removed, nil
	}
	if len(failed) > 0 {
		log.Warn("could not remove the sockets of drivers no longer configured", "sockets", len(failed), "first", failed[0].path, "err", failed[0].err)
	}
	if len(removed) > 0 {
		log.Info("removed the sockets of drivers no longer configured; kubelet deregisters them", "sockets", len(removed),
			"first", strings.Join(removed[:min(3, len(removed))], ", ")+", …")
	}
	return removed, nil
}

// perSocketLines is how many sockets removeOrphans logs one by one; more are summed up.
const perSocketLines = 8

// ownedRecord writes the record of the sockets multireg owns (recordOwned) for each applied
// configuration, and retries a write that failed (a read-only or vanished directory) until it
// succeeds: without it, a driver removed while multireg does not run would keep its socket
// forever.
type ownedRecord struct {
	log *slog.Logger

	// guards: pending, lastErr.
	mu      sync.Mutex
	pending *config.RegistrarConfig // a configuration whose record failed; nil when written
	lastErr string
}

// set writes the record of c with write, and keeps c for retry when that fails.
func (o *ownedRecord) set(c *config.RegistrarConfig, write func(*config.RegistrarConfig) error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.pending = c
	o.write(write)
}

// retry writes again a record that failed, if any.
func (o *ownedRecord) retry(write func(*config.RegistrarConfig) error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.pending != nil {
		o.write(write)
	}
}

func (o *ownedRecord) write(write func(*config.RegistrarConfig) error) {
	err := write(o.pending)
	switch {
	case err == nil:
		if o.lastErr != "" {
			o.log.Info("recorded the sockets multireg owns", "dir", o.pending.RegistrationDir)
		}
		o.pending, o.lastErr = nil, ""
	case err.Error() != o.lastErr:
		o.lastErr = err.Error()
		o.log.Warn("the sockets of drivers removed while multireg does not run may stay; retrying", "err", err)
	}
}

// socketNames returns the socket file names of the configured drivers.
func socketNames(c *config.RegistrarConfig) []string {
	names := make([]string, 0, len(c.Drivers))
	for _, d := range c.Drivers {
		names = append(names, d.SocketNames()...)
	}
	return names
}

// driverNames returns the names of the configured drivers.
func driverNames(c *config.RegistrarConfig) []string {
	names := make([]string, 0, len(c.Drivers))
	for _, d := range c.Drivers {
		names = append(names, d.Name)
	}
	return names
}
