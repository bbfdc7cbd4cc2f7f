package reload

import (
	"context"
	"log/slog"
	"path/filepath"
	"time"

	"github.com/fsnotify/fsnotify"
)

// rewatchInterval paces attempts to watch the config directory again after it was deleted.
const rewatchInterval = time.Second

// dirWatcher watches the directory of the config file, not the file: editors and `mv` replace
// the file, delete-and-recreate makes a new inode, and a Kubernetes ConfigMap volume swaps
// its `..data` symlink; a watch on the file itself would miss or lose all of these. Any event
// in the directory is a reason to look at the file; the reloader's content hash decides
// whether anything changed.
type dirWatcher struct {
	dir string
	fs  *fsnotify.Watcher
	log *slog.Logger
}

func newDirWatcher(path string, log *slog.Logger) (*dirWatcher, error) {
	fs, err := fsnotify.NewWatcher()
	if err != nil {
		return nil, err
	}
	return &dirWatcher{dir: filepath.Dir(path), fs: fs, log: log}, nil
}

// run calls kick for every event in the directory until ctx ends, then closes the watcher.
// It also kicks whenever a watch is put in place (events before it are lost): at start, and
// after the directory went away and could be watched again (tried once a second).
func (w *dirWatcher) run(ctx context.Context, kick func()) {
	defer w.fs.Close()
	watching := w.add()
	if watching {
		kick() // the file may have changed between its first read and this watch
	}
	// The retry ticker runs only while the directory is not watched: no wake-ups otherwise.
	retry := time.NewTicker(rewatchInterval)
	defer retry.Stop()
	if watching {
		retry.Stop()
	}
	for {
		select {
		case <-ctx.Done():
			return
		case ev, ok := <-w.fs.Events:
			if !ok {
				return
			}
			if ev.Name == w.dir && ev.Has(fsnotify.Remove|fsnotify.Rename) {
				watching = false // inotify dropped the watch with the directory
				retry.Reset(rewatchInterval)
			}
			kick()
		case err, ok := <-w.fs.Errors:
			if !ok {
				return
			}
			w.log.Warn("config watch error; re-reading the file", "dir", w.dir, "err", err)
			kick()
		case <-retry.C:
			if !watching {
				if watching = w.add(); watching {
					retry.Stop()
					kick()
				}
			}
		}
	}
}

func (w *dirWatcher) add() bool {
	if err := w.fs.Add(w.dir); err != nil {
		w.log.Debug("watch config directory", "dir", w.dir, "err", err)
		return false
	}
	return true
}
