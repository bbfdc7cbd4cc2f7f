//go:build linux

package main

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
)

// stoppedName marks a registration directory whose last holder stopped cleanly (SIGTERM or
// SIGINT) rather than crashed. An idle instance, which handed the directory over, takes it
// back only after a crash of its successor: a successor stopped on purpose (systemctl stop,
// an operator ending an upgrade on the new binary) means no instance should serve, and the
// idle one coming back to life would undo that. Every instance that takes the directory
// removes the mark, so that its own crash is not read as a clean stop. Its leading dot makes
// kubelet ignore it.
const stoppedName = ".multireg.stopped"

// markStopped records, while the directory is still held, that its holder stops cleanly.
func markStopped(dir string) error {
	return os.WriteFile(filepath.Join(dir, stoppedName), []byte("stopped cleanly; an idle instance does not take the directory back\n"), 0o600)
}

// takeStopped removes the mark of a clean stop, and reports whether it was there.
func takeStopped(dir string) (bool, error) {
	err := os.Remove(filepath.Join(dir, stoppedName))
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	return err == nil, err
}
