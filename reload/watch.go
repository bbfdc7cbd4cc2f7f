package reload

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/fsnotify/fsnotify"
)

// rewatchInterval paces attempts to watch a directory again after it was deleted.
const rewatchInterval = time.Second

// dirWatcher watches the directory of the config file, not the file: editors and `mv` replace
// the file, delete-and-recreate makes a new inode, and a Kubernetes ConfigMap volume swaps
// its `..data` symlink; a watch on the file itself would miss or lose all of these. When the
// config path is a symlink to a file in another directory, that directory is watched too, so
// that an edit of the target in place is seen; where the symlink leads is looked up again
// whenever the reloader reads the file (follow), and the watch moves with it. Any event in a
// watched directory is a reason to look at the file; the reloader's content hash decides
// whether anything changed.
type dirWatcher struct {
	path    string
	dir     string // the config path's own directory, always watched
	fs      *fsnotify.Watcher
	log     *slog.Logger
	resolve chan struct{} // capacity 1: a pending "look where the path leads"

	watched map[string]bool // the directories watched now; owned by run
}

func newDirWatcher(path string, log *slog.Logger) (*dirWatcher, error) {
	fs, err := fsnotify.NewWatcher()
	if err != nil {
		return nil, err
	}
	return &dirWatcher{path: path, dir: filepath.Dir(path), fs: fs, log: log,
		resolve: make(chan struct{}, 1), watched: map[string]bool{}}, nil
}

// follow asks run to look again where the config path leads. It never blocks.
func (w *dirWatcher) follow() {
	select {
	case w.resolve <- struct{}{}:
	default:
	}
}

// run calls kick for every event in the watched directories until ctx ends, then closes the
// watcher. It also kicks whenever a watch is put in place (events before it are lost): at
// start, when the symlink's target moved to another directory, and after a directory went
// away and could be watched again (tried once a second).
func (w *dirWatcher) run(ctx context.Context, kick func()) {
	defer w.fs.Close()
	// The retry ticker runs only while a directory is not watched: no wake-ups otherwise.
	retry := time.NewTicker(rewatchInterval)
	defer retry.Stop()
	rewatch := func() {
		added, missing := w.sync()
		if missing {
			retry.Reset(rewatchInterval)
		} else {
			retry.Stop()
		}
		if added {
			kick()
		}
	}
	rewatch()
	for {
		select {
		case <-ctx.Done():
			return
		case ev, ok := <-w.fs.Events:
			if !ok {
				return
			}
			if w.watched[ev.Name] && ev.Has(fsnotify.Remove|fsnotify.Rename) {
				delete(w.watched, ev.Name) // inotify dropped the watch with the directory
				retry.Reset(rewatchInterval)
			}
			kick()
		case err, ok := <-w.fs.Errors:
			if !ok {
				return
			}
			w.log.Warn("config watch error; re-reading the file", "config", w.path, "err", err)
			kick()
		case <-retry.C:
			rewatch()
		case <-w.resolve:
			rewatch()
		}
	}
}

// sync watches the config path's directory and the directory of the file it leads to, and
// stops watching any other. It reports whether a watch was put in place, and whether one is
// missing (a directory that does not exist, or a symlink that leads nowhere yet).
func (w *dirWatcher) sync() (added, missing bool) {
	want := map[string]bool{w.dir: true}
	target, ok := w.targetDir()
	if target != "" {
		want[target] = true
	}
	missing = !ok
	for d := range w.watched {
		if !want[d] {
			_ = w.fs.Remove(d) // fails only if inotify dropped it already, with its directory
			delete(w.watched, d)
		}
	}
	for d := range want {
		if w.watched[d] {
			continue
		}
		if err := w.fs.Add(d); err != nil {
			w.log.Debug("watch config directory", "dir", d, "err", err)
			missing = true
			continue
		}
		w.watched[d] = true
		added = true
	}
	return added, missing
}

// targetDir returns the directory of the file the config path leads to when it is another
// directory than the path's own, and "" otherwise. ok is false while the path is a symlink
// that leads nowhere (its target may appear in a directory to watch).
func (w *dirWatcher) targetDir() (dir string, ok bool) {
	resolved, err := filepath.EvalSymlinks(w.path)
	if err != nil {
		fi, lerr := os.Lstat(w.path)
		return "", lerr != nil || fi.Mode()&os.ModeSymlink == 0
	}
	own, err := filepath.EvalSymlinks(w.dir)
	if dir = filepath.Dir(resolved); err == nil && dir == own {
		return "", true
	}
	return dir, true
}
