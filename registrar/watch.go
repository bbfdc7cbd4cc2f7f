package registrar

import (
	"context"
	"errors"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sync"

	"github.com/fsnotify/fsnotify"
)

// watcher shares one inotify instance among every loop of the process. Linux allows 128
// inotify instances per user by default; one per driver would stop at 128 drivers.
//
// A subscription names one file. Any event on that file, the loss of its directory's watch
// (the directory was deleted or moved) or a queue overflow marks the subscription and wakes
// its owner. Events are only hints: the owner looks at the file itself to decide what
// happened, so a coalesced or spurious wake-up is harmless.
type watcher struct {
	fs  *fsnotify.Watcher
	log *slog.Logger

	// opsMu serializes adding and removing inotify watches. It is never taken by dispatch:
	// fsnotify may hold its own lock while it waits for dispatch to read an event.
	opsMu sync.Mutex
	// mu guards dirs.
	mu   sync.Mutex
	dirs map[string]*watchedDir
}

type watchedDir struct {
	active bool // an inotify watch is in place
	lost   int  // how many times the watch was lost
	subs   map[*subscription]struct{}
}

// Wake-up reasons a subscription accumulates until its owner reads them.
const (
	evCreate  = 1 << iota // the file was created or renamed into place
	evChange              // removed, renamed away, attributes changed
	evDirGone             // the directory's watch is gone: the file can no longer be watched
	evResync              // events may have been lost
)

// subscription is one loop's interest in one file.
type subscription struct {
	w    *watcher
	dir  string
	name string
	c    chan struct{} // capacity 1: a pending wake-up

	mu     sync.Mutex
	events int
}

func newWatcher(log *slog.Logger) (*watcher, error) {
	fs, err := fsnotify.NewWatcher()
	if err != nil {
		return nil, err
	}
	return &watcher{fs: fs, log: log, dirs: map[string]*watchedDir{}}, nil
}

// run dispatches events until ctx is done, then closes the inotify instance. It keeps reading
// until fsnotify has closed its channels: fsnotify may hold its lock while it waits for us to
// take an event or an error, and Close needs that lock.
func (w *watcher) run(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			closed := make(chan struct{})
			go func() {
				defer close(closed)
				w.fs.Close()
			}()
			for events, errs := w.fs.Events, w.fs.Errors; events != nil || errs != nil; {
				select {
				case _, ok := <-events:
					if !ok {
						events = nil
					}
				case _, ok := <-errs:
					if !ok {
						errs = nil
					}
				}
			}
			<-closed
			return
		case ev, ok := <-w.fs.Events:
			if !ok {
				return
			}
			w.dispatch(ev)
		case err, ok := <-w.fs.Errors:
			if !ok {
				return
			}
			w.log.Warn("file watch error; rechecking every watched file", "err", err)
			w.kickAll(evResync)
		}
	}
}

func (w *watcher) dispatch(ev fsnotify.Event) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if d, ok := w.dirs[ev.Name]; ok && ev.Has(fsnotify.Remove|fsnotify.Rename) {
		// The watched directory itself is gone; inotify dropped its watch.
		d.active = false
		d.lost++
		for s := range d.subs {
			s.kick(evDirGone)
		}
	}
	d, ok := w.dirs[filepath.Dir(ev.Name)]
	if !ok {
		return
	}
	base := filepath.Base(ev.Name)
	for s := range d.subs {
		if s.name != base {
			continue
		}
		if ev.Has(fsnotify.Create) {
			s.kick(evCreate)
		} else {
			s.kick(evChange)
		}
	}
}

func (w *watcher) kickAll(what int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, d := range w.dirs {
		for s := range d.subs {
			s.kick(what)
		}
	}
}

// subscribe returns a subscription for path and tries to watch its directory. It never
// fails: when the directory cannot be watched (it does not exist yet), watching reports
// false and the owner calls rewatch later.
func (w *watcher) subscribe(path string) *subscription {
	s := &subscription{w: w, dir: filepath.Dir(path), name: filepath.Base(path), c: make(chan struct{}, 1)}
	w.mu.Lock()
	d, ok := w.dirs[s.dir]
	if !ok {
		d = &watchedDir{subs: map[*subscription]struct{}{}}
		w.dirs[s.dir] = d
	}
	d.subs[s] = struct{}{}
	w.mu.Unlock()
	return s
}

// rewatch makes sure the subscription's directory is watched. It reports whether a new
// watch was put in place (events may have been missed before it) and fails when the
// directory cannot be watched.
func (s *subscription) rewatch() (renewed bool, err error) {
	w := s.w
	w.opsMu.Lock()
	defer w.opsMu.Unlock()
	w.mu.Lock()
	d := w.dirs[s.dir]
	active, lost := d.active, d.lost
	w.mu.Unlock()
	if active {
		return false, nil
	}
	if err := w.fs.Add(s.dir); err != nil {
		return false, err
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if d.lost != lost {
		return false, errors.New("directory vanished while it was being watched")
	}
	d.active = true
	return true, nil
}

// ancestor returns a subscription that is kicked with evCreate when the next missing component
// of the subscription's directory is created: the directory does not exist, so it cannot be
// watched, but its nearest existing ancestor can. It reports appeared when the directory, or
// that component, exists after all (it was created meanwhile); then it returns no
// subscription. The caller closes the subscription it gets.
func (s *subscription) ancestor() (anc *subscription, appeared bool, err error) {
	missing := s.dir
	for {
		parent := filepath.Dir(missing)
		if parent == missing {
			return nil, true, nil // the root exists
		}
		if _, err := os.Stat(parent); err == nil {
			break
		} else if !errors.Is(err, fs.ErrNotExist) {
			return nil, false, err
		}
		missing = parent
	}
	if _, err := os.Stat(missing); err == nil {
		return nil, true, nil
	}
	anc = s.w.subscribe(missing)
	if _, err := anc.rewatch(); err != nil {
		anc.close()
		return nil, false, err
	}
	// Created between the look and the watch: its event is lost, say so now.
	if _, err := os.Stat(missing); err == nil {
		anc.close()
		return nil, true, nil
	}
	return anc, false, nil
}

// watching reports whether the subscription's directory is watched.
func (s *subscription) watching() bool {
	s.w.mu.Lock()
	defer s.w.mu.Unlock()
	return s.w.dirs[s.dir].active
}

// close ends the subscription; the directory's watch is dropped with its last subscription.
func (s *subscription) close() {
	w := s.w
	w.opsMu.Lock()
	defer w.opsMu.Unlock()
	w.mu.Lock()
	d := w.dirs[s.dir]
	delete(d.subs, s)
	last, active := len(d.subs) == 0, d.active
	if last {
		delete(w.dirs, s.dir)
	}
	w.mu.Unlock()
	if last && active {
		if err := w.fs.Remove(s.dir); err != nil && !errors.Is(err, fsnotify.ErrNonExistentWatch) && !errors.Is(err, fsnotify.ErrClosed) {
			w.log.Debug("unwatch", "dir", s.dir, "err", err)
		}
	}
}

func (s *subscription) kick(what int) {
	s.mu.Lock()
	s.events |= what
	s.mu.Unlock()
	select {
	case s.c <- struct{}{}:
	default:
	}
}

// take returns and clears the accumulated wake-up reasons.
func (s *subscription) take() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.events
	s.events = 0
	return e
}
