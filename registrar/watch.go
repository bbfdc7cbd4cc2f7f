package registrar

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/fsnotify/fsnotify"
	"multireg.dev/multireg/internal/fsid"
)

// dirPollInterval paces the look at a file for which inotify refuses every watch (its watch
// limit). It only runs in that state.
const dirPollInterval = time.Second

// watcher shares one inotify instance among every loop of the process. Linux allows 128
// inotify instances per user by default; one per driver would stop at 128 drivers.
//
// A subscription names one file and keeps one promise to its owner: from subscribe on, the
// owner is woken when the file may have changed. It keeps the promise by itself:
//   - it watches the file's directory, and watches it again after its watch was lost (the
//     directory was deleted or moved);
//   - while the directory is missing, it watches the nearest existing ancestor and descends as
//     the missing directories appear;
//   - where inotify refuses a watch (its watch limit), it looks at the file itself every
//     dirPollInterval.
//
// The mending runs in take, on the owner's goroutine (dispatch never adds a watch, see opsMu),
// and a look is due when a timer kicks the subscription: no goroutine runs for it.
//
// A wake-up is only a hint: it may be coalesced or spurious, and take says what it may mean.
// The owner looks at the file itself to decide what happened.
type watcher struct {
	fs  *fsnotify.Watcher
	log *slog.Logger

	// opsMu serializes adding and removing inotify watches, and with them the moves of
	// subscriptions between directories. It is never taken by dispatch: fsnotify may hold its
	// own lock while it waits for dispatch to read an event.
	opsMu sync.Mutex
	// mu guards dirs, and where each subscription is registered.
	mu   sync.Mutex
	dirs map[string]*watchedDir
}

type watchedDir struct {
	active bool // an inotify watch is in place
	lost   int  // how many times the watch was lost
	subs   map[*subscription]struct{}
}

// change is what may have happened to a subscription's file since its owner last took the
// changes. The bits accumulate until taken.
type change uint8

const (
	evCreated change = 1 << iota // the file was created or renamed into place
	evChanged                    // removed, renamed away, attributes changed
	evLost                       // events may have been lost: only a look at the file tells
	evDirGone                    // the file's directory was removed or moved away
	evMend                       // internal, never taken: the watch must be mended
)

// subscription is one loop's interest in one file, or in the files of one directory whose
// names match a pattern (an endpoint pattern). Only its owner's goroutine
// calls take and close.
type subscription struct {
	w       *watcher
	path    string
	dir     string        // the file's directory
	name    string        // the file's name in dir, or the pattern of their names
	pattern bool          // name is a pattern
	c       chan struct{} // capacity 1: a pending wake-up

	// Where the subscription is registered, written by its owner under w.mu: at is dir or,
	// while dir is missing, its nearest existing ancestor; want is the name awaited in at
	// (the file's, or the next missing directory's).
	at, want string

	mu     sync.Mutex
	events change

	// While inotify refuses the watch: the timer of the next look, and the file at the last
	// (for a pattern, the matching files: seenSet).
	poll       *time.Timer
	seen       fsid.ID
	seenExists bool
	seenSet    string
}

// awaits reports whether base, a name in the directory where s is registered, is what s awaits
// there: the file, a file matching its pattern, or the next missing directory on the way.
func (s *subscription) awaits(base string) bool {
	if s.pattern && s.at == s.dir {
		ok, _ := filepath.Match(s.name, base)
		return ok
	}
	return s.want == base
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
			w.kickAll(evLost | evMend)
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
			if s.at == s.dir {
				s.kick(evDirGone | evMend)
			} else {
				s.kick(evMend) // an ancestor: watch a higher one
			}
		}
	}
	d, ok := w.dirs[filepath.Dir(ev.Name)]
	if !ok {
		return
	}
	base := filepath.Base(ev.Name)
	for s := range d.subs {
		switch {
		case !s.awaits(base):
		case s.at != s.dir:
			s.kick(evMend) // a directory on the way to the file: watch deeper
		case ev.Has(fsnotify.Create):
			s.kick(evCreated)
		default:
			s.kick(evChanged)
		}
	}
}

func (w *watcher) kickAll(what change) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, d := range w.dirs {
		for s := range d.subs {
			s.kick(what)
		}
	}
}

// subscribe returns a subscription for path, whose promise holds from the return on. It never
// fails: what cannot be watched is looked at.
func (w *watcher) subscribe(path string) *subscription {
	return w.subscribeTo(path, false)
}

// subscribeMatching is subscribe for the files of path's directory whose names match path's
// last element, a pattern (path/filepath.Match).
func (w *watcher) subscribeMatching(path string) *subscription {
	return w.subscribeTo(path, true)
}

func (w *watcher) subscribeTo(path string, pattern bool) *subscription {
	s := &subscription{w: w, path: path, dir: filepath.Dir(path), name: filepath.Base(path), pattern: pattern, c: make(chan struct{}, 1)}
	s.mend() // what it reports is moot: the owner looks at the file after subscribing
	return s
}

// take returns and clears what may have happened to the file since the last take. It mends
// the watch first when that is due, and then reports evLost if events may have been missed.
func (s *subscription) take() change {
	s.mu.Lock()
	ev := s.events
	s.events = 0
	s.mu.Unlock()
	if ev&evMend != 0 {
		ev |= s.mend()
	}
	return ev &^ evMend
}

// close ends the subscription; a directory's watch is dropped with its last subscription.
func (s *subscription) close() {
	w := s.w
	w.opsMu.Lock()
	defer w.opsMu.Unlock()
	if s.poll != nil {
		s.poll.Stop()
	}
	w.mu.Lock()
	unwatch := w.leaveLocked(s)
	w.mu.Unlock()
	w.unwatch(unwatch)
}

func (s *subscription) kick(what change) {
	s.mu.Lock()
	s.events |= what
	s.mu.Unlock()
	select {
	case s.c <- struct{}{}:
	default:
	}
}

// mend puts in place what keeps the promise: the watch of the file's directory, or of its
// nearest existing ancestor, or else a look every dirPollInterval. It reports evLost when a
// watch was added or moved (events before it are lost), and while polling what the look found.
func (s *subscription) mend() change {
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
		w.log.Info("watching a file's directory again", "path", s.path, "dir", s.at)
		return evLost
	}
	if added || s.at != was {
		return evLost
	}
	return 0
}

// place registers the subscription where a watch serves it: in the file's directory or, while
// that is missing, in its nearest existing ancestor, awaiting the next missing directory. It
// reports whether it added a watch, and fails where inotify refuses one. The caller holds opsMu.
func (s *subscription) place() (added bool, err error) {
	at, want := s.dir, s.name
	for {
		added, err = s.w.watchAt(s, at, want)
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
			s.kick(evMend)
		}
	}
	return added, nil
}

// look is the poll, while inotify refuses the watch the subscription needs: it reports how the
// file differs from the last look, and schedules the next. The caller holds opsMu.
func (s *subscription) look(watchErr error) change {
	if s.pattern {
		return s.lookPattern(watchErr)
	}
	id, _, err := fsid.Stat(s.path)
	exists := err == nil
	prev, existed := s.seen, s.seenExists
	s.seen, s.seenExists = id, exists
	if s.poll == nil {
		s.startPoll(watchErr)
		return evLost // what happened before the first look is unknown
	}
	s.poll.Reset(dirPollInterval)
	switch {
	case exists && (!existed || id.Key() != prev.Key()):
		return evCreated
	case exists && id != prev:
		return evChanged | evLost // its attributes changed, or a new file got the inode back
	case !exists && existed:
		return evChanged
	}
	return 0
}

// lookPattern is look for a pattern: it reports evCreated when the matching files differ from
// the last look (one appeared, went or was created anew), which the owner looks at itself.
func (s *subscription) lookPattern(watchErr error) change {
	var set strings.Builder
	for _, e := range matchingEntries(s.dir, s.name) {
		id, _, _ := fsid.Stat(filepath.Join(s.dir, e.Name()))
		fmt.Fprintf(&set, "%s %v\n", e.Name(), id)
	}
	prev := s.seenSet
	s.seenSet = set.String()
	if s.poll == nil {
		s.startPoll(watchErr)
		return evLost
	}
	s.poll.Reset(dirPollInterval)
	if s.seenSet != prev {
		return evCreated | evChanged
	}
	return 0
}

// matchingEntries lists the files of dir whose names match pattern (path/filepath.Match); dir
// is taken as it is written, whatever bytes it holds. A directory that cannot be read has none.
func matchingEntries(dir, pattern string) []fs.DirEntry {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil
	}
	return slices.DeleteFunc(entries, func(e fs.DirEntry) bool {
		ok, _ := filepath.Match(pattern, e.Name()) // the only error is a malformed pattern, refused by config
		return !ok
	})
}

// startPoll starts the looks, while inotify refuses the watch s needs, and says why.
func (s *subscription) startPoll(watchErr error) {
	if errors.Is(watchErr, syscall.ENOSPC) {
		watchErr = fmt.Errorf("%w: inotify's watch limit is reached (sysctl fs.inotify.max_user_watches)", watchErr)
	}
	s.w.log.Warn("cannot watch a file's directory; looking at the file every "+dirPollInterval.String(), "path", s.path, "err", watchErr)
	s.poll = time.AfterFunc(dirPollInterval, func() { s.kick(evMend) })
}

// watchAt registers s in dir, awaiting want there, and makes sure dir is watched. It reports
// whether it added the watch. The caller holds opsMu.
func (w *watcher) watchAt(s *subscription, dir, want string) (added bool, err error) {
	w.mu.Lock()
	var unwatch string
	if s.at != dir {
		unwatch = w.leaveLocked(s)
		d, ok := w.dirs[dir]
		if !ok {
			d = &watchedDir{subs: map[*subscription]struct{}{}}
			w.dirs[dir] = d
		}
		d.subs[s] = struct{}{}
		s.at = dir
	}
	s.want = want
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
func (w *watcher) leaveLocked(s *subscription) (unwatch string) {
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
func (w *watcher) unwatch(dir string) {
	if dir == "" {
		return
	}
	if err := w.fs.Remove(dir); err != nil && !errors.Is(err, fsnotify.ErrNonExistentWatch) && !errors.Is(err, fsnotify.ErrClosed) {
		w.log.Debug("unwatch", "dir", dir, "err", err)
	}
}
