// Package fswatch shares one inotify instance among every registration loop of the process.
package fswatch

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/fsnotify/fsnotify"
	"multireg.dev/multireg/internal/fsid"
)

// Watcher shares one inotify instance among every loop of the process. Linux allows 128
// inotify instances per user by default; one per driver would stop at 128 drivers.
//
// A subscription names one file and keeps one promise to its owner: from Subscribe on, the
// owner is woken when the file may have changed. It keeps the promise by itself:
//   - it watches the file's directory, and watches it again after its watch was lost (the
//     directory was deleted or moved);
//   - while the directory is missing, it watches the nearest existing ancestor and descends as
//     the missing directories appear;
//   - where inotify refuses a watch (its watch limit), it looks at the file itself every
//     PollInterval.
//
// The mending runs in Take, on the owner's goroutine (dispatch never adds a watch, see opsMu),
// and a look is due when a timer kicks the subscription: no goroutine runs for it.
//
// A wake-up is only a hint: it may be coalesced or spurious, and Take says what it may mean.
// The owner looks at the file itself to decide what happened.
type Watcher struct {
	fs  *fsnotify.Watcher
	log *slog.Logger

	// guards: polling. It also serializes adding and removing inotify watches, and with them
	// the moves of subscriptions between directories. It is never taken by dispatch: fsnotify
	// may hold its own lock while it waits for dispatch to read an event.
	opsMu sync.Mutex
	// guards: dirs, and the watchedDir records in it (which are the watcher's alone).
	mu   sync.Mutex
	dirs map[string]*watchedDir
	// polling counts the subscriptions that look at their file themselves because inotify
	// refused a watch (poll.go). One warning when it leaves 0, one info line when it is back
	// to 0.
	polling int
}

// watchedDir is a directory where subscriptions are registered: the file's own, or an
// ancestor of it while the file's is missing.
type watchedDir struct {
	active bool                       // an inotify watch is in place
	lost   int                        // how many times the watch was lost
	subs   map[*Subscription]struct{} // registered here (Subscription.awaitedIn says for what)
}

// Change is what may have happened to a subscription's file since its owner last took the
// changes. The bits accumulate until taken.
type Change uint8

const (
	Created Change = 1 << iota // the file was created or renamed into place
	Changed                    // removed, renamed away, attributes changed
	Lost                       // events may have been lost: only a look at the file tells
	DirGone                    // the file's directory was removed or moved away
	mend                       // internal, never taken: the watch must be mended
)

// Subscription is one loop's interest in one file, or in the files of one directory whose
// names match a pattern (an endpoint pattern). Only its owner's goroutine
// calls Take and Close.
type Subscription struct {
	w       *Watcher
	path    string
	dir     string        // the file's directory
	name    string        // the file's name in dir, or the pattern of their names
	pattern bool          // name is a pattern
	c       chan struct{} // capacity 1: a pending wake-up

	// guards: events.
	mu     sync.Mutex
	events Change

	// The owner's goroutine alone uses the fields below (Subscribe, Take and Close run on it).
	// at is where the subscription is registered: dir or, while dir is missing, its nearest
	// existing ancestor; "" when nowhere. The watcher knows it as the directory whose record
	// holds the subscription.
	at string
	// While inotify refuses the watch: the timer of the next look, and the file at the last
	// (for a pattern, the matching files: seenSet).
	poll       *time.Timer
	seen       fsid.ID
	seenExists bool
	seenSet    string
}

// C is woken when the subscription's file may have changed; Take says what may have happened.
func (s *Subscription) C() <-chan struct{} { return s.c }

// Path is the file subscribed to (for a pattern, the pattern's path).
func (s *Subscription) Path() string { return s.path }

// awaits reports whether base, a name in at, the directory where s is registered, is what s
// awaits there: the file, a file matching its pattern, or the next missing directory on the
// way.
func (s *Subscription) awaits(at, base string) bool {
	if s.pattern && at == s.dir {
		ok, _ := filepath.Match(s.name, base)
		return ok
	}
	return s.awaitedIn(at) == base
}

// awaitedIn is the name s awaits in at, the directory where it is registered: in its own
// directory the file's name (or pattern), in an ancestor the next directory on the way to it.
func (s *Subscription) awaitedIn(at string) string {
	if at == s.dir {
		return s.name
	}
	rest := strings.TrimPrefix(strings.TrimPrefix(s.dir, at), string(filepath.Separator))
	if i := strings.IndexByte(rest, filepath.Separator); i >= 0 {
		rest = rest[:i]
	}
	return rest
}

// New returns a watcher with its inotify instance; Run must run for subscriptions to be woken,
// and closes it.
func New(log *slog.Logger) (*Watcher, error) {
	fs, err := fsnotify.NewWatcher()
	if err != nil {
		return nil, newError(err)
	}
	return &Watcher{fs: fs, log: log, dirs: map[string]*watchedDir{}}, nil
}

// Run dispatches events until ctx is done, then closes the inotify instance. It keeps reading
// until fsnotify has closed its channels: fsnotify may hold its lock while it waits for us to
// take an event or an error, and Close needs that lock.
func (w *Watcher) Run(ctx context.Context) {
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
			w.kickAll(Lost | mend)
		}
	}
}

func (w *Watcher) dispatch(ev fsnotify.Event) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if d, ok := w.dirs[ev.Name]; ok && ev.Has(fsnotify.Remove|fsnotify.Rename) {
		// The watched directory itself is gone; inotify dropped its watch.
		d.active = false
		d.lost++
		for s := range d.subs {
			if ev.Name == s.dir {
				s.kick(DirGone | mend)
			} else {
				s.kick(mend) // an ancestor: watch a higher one
			}
		}
	}
	at := filepath.Dir(ev.Name)
	d, ok := w.dirs[at]
	if !ok {
		return
	}
	base := filepath.Base(ev.Name)
	for s := range d.subs {
		switch {
		case !s.awaits(at, base):
		case at != s.dir:
			s.kick(mend) // a directory on the way to the file: watch deeper
		case ev.Has(fsnotify.Create):
			s.kick(Created)
		default:
			s.kick(Changed)
		}
	}
}

func (w *Watcher) kickAll(what Change) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, d := range w.dirs {
		for s := range d.subs {
			s.kick(what)
		}
	}
}

// Subscribe returns a subscription for path, whose promise holds from the return on. It never
// fails: what cannot be watched is looked at.
func (w *Watcher) Subscribe(path string) *Subscription {
	return w.subscribeTo(path, false)
}

// SubscribeMatching is Subscribe for the files of path's directory whose names match path's
// last element, a pattern (path/filepath.Match).
func (w *Watcher) SubscribeMatching(path string) *Subscription {
	return w.subscribeTo(path, true)
}

func (w *Watcher) subscribeTo(path string, pattern bool) *Subscription {
	s := &Subscription{w: w, path: path, dir: filepath.Dir(path), name: filepath.Base(path), pattern: pattern, c: make(chan struct{}, 1)}
	s.mend() // what it reports is moot: the owner looks at the file after subscribing
	return s
}

// Take returns and clears what may have happened to the file since the last Take. It mends
// the watch first when that is due, and then reports Lost if events may have been missed.
func (s *Subscription) Take() Change {
	s.mu.Lock()
	ev := s.events
	s.events = 0
	s.mu.Unlock()
	if ev&mend != 0 {
		ev |= s.mend()
	}
	return ev &^ mend
}

// Close ends the subscription; a directory's watch is dropped with its last subscription.
func (s *Subscription) Close() {
	w := s.w
	w.opsMu.Lock()
	defer w.opsMu.Unlock()
	if s.poll != nil {
		s.poll.Stop()
		s.poll = nil
		w.pollEnded()
	}
	w.mu.Lock()
	unwatch := w.leaveLocked(s)
	w.mu.Unlock()
	w.unwatch(unwatch)
}

func (s *Subscription) kick(what Change) {
	s.mu.Lock()
	s.events |= what
	s.mu.Unlock()
	select {
	case s.c <- struct{}{}:
	default:
	}
}

// mend puts in place what keeps the promise: the watch of the file's directory, or of its
// nearest existing ancestor, or else a look every PollInterval. It reports Lost when a
// watch was added or moved (events before it are lost), and while polling what the look found.
func (s *Subscription) mend() Change {
	w := s.w
	w.opsMu.Lock()
	defer w.opsMu.Unlock()
	was := s.at
	added, err := s.place()
	if err != nil {
		return s.look(err)
	}
	if s.poll != nil {
		s.poll.Stop()
		s.poll = nil
		w.log.Debug("watching a file's directory again", "path", s.path, "dir", s.at)
		w.pollEnded()
		return Lost
	}
	if added || s.at != was {
		return Lost
	}
	return 0
}

// place registers the subscription where a watch serves it: in the file's directory or, while
// that is missing, in its nearest existing ancestor, awaiting the next missing directory. It
// reports whether it added a watch, and fails where inotify refuses one. The caller holds opsMu.
func (s *Subscription) place() (added bool, err error) {
	at, want := s.dir, s.name
	for {
		added, err = s.w.watchAt(s, at)
		if err == nil {
			break
		}
		parent := filepath.Dir(at)
		if !errors.Is(err, fs.ErrNotExist) || parent == at {
			return false, err
		}
		at, want = parent, filepath.Base(at)
	}
	if at != s.dir {
		// Created between the failed watch below and this one: its event is lost, mend again.
		if _, err := os.Stat(filepath.Join(at, want)); err == nil {
			s.kick(mend)
		}
	}
	return added, nil
}

// watchAt registers s in dir, and makes sure dir is watched. It reports whether it added the
// watch. The caller holds opsMu.
func (w *Watcher) watchAt(s *Subscription, dir string) (added bool, err error) {
	w.mu.Lock()
	var unwatch string
	if s.at != dir {
		unwatch = w.leaveLocked(s)
		d, ok := w.dirs[dir]
		if !ok {
			d = &watchedDir{subs: map[*Subscription]struct{}{}}
			w.dirs[dir] = d
		}
		d.subs[s] = struct{}{}
		s.at = dir
	}
	d := w.dirs[dir]
	active, lost := d.active, d.lost
	w.mu.Unlock()
	w.unwatch(unwatch)
	if active {
		return false, nil
	}
	if err := w.fs.Add(dir); err != nil {
		return false, err
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if d.lost != lost {
		return false, fmt.Errorf("watch %s: it vanished while it was being watched: %w", dir, fs.ErrNotExist)
	}
	d.active = true
	return true, nil
}

// leaveLocked unregisters s from where it is. It returns the directory to unwatch when s was
// its last subscription and it is watched, else "". The caller holds opsMu and mu.
func (w *Watcher) leaveLocked(s *Subscription) (unwatch string) {
	d, ok := w.dirs[s.at]
	if !ok {
		return ""
	}
	delete(d.subs, s)
	if len(d.subs) == 0 {
		delete(w.dirs, s.at)
		if d.active {
			unwatch = s.at
		}
	}
	s.at = ""
	return unwatch
}

// unwatch removes dir's watch, if dir is not "". The caller holds opsMu, not mu.
func (w *Watcher) unwatch(dir string) {
	if dir == "" {
		return
	}
	if err := w.fs.Remove(dir); err != nil && !errors.Is(err, fsnotify.ErrNonExistentWatch) && !errors.Is(err, fsnotify.ErrClosed) {
		w.log.Debug("unwatch", "dir", dir, "err", err)
	}
}

// Watches reports whether w has an inotify watch on dir for the file, or the missing
// directory, name: what a test of its users can wait for.
func (w *Watcher) Watches(dir, name string) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	d, ok := w.dirs[dir]
	if !ok || !d.active {
		return false
	}
	for s := range d.subs {
		if s.awaitedIn(dir) == name {
			return true
		}
	}
	return false
}
