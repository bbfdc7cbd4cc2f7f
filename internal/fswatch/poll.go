package fswatch

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"multireg.dev/multireg/internal/fsid"
)

// Where inotify refuses a watch (its watch limit), a subscription looks at its file itself.

// PollInterval paces the look at a file for which inotify refuses every watch (its watch
// limit). It only runs in that state.
const PollInterval = time.Second

// look is the poll, while inotify refuses the watch the subscription needs: it reports how the
// file differs from the last look, and schedules the next. The caller holds opsMu.
func (s *Subscription) look(watchErr error) Change {
	if s.pattern {
		return s.lookPattern(watchErr)
	}
	id, _, err := fsid.Stat(s.path)
	exists := err == nil
	prev, existed := s.seen, s.seenExists
	s.seen, s.seenExists = id, exists
	if s.poll == nil {
		s.startPoll(watchErr)
		return Lost // what happened before the first look is unknown
	}
	s.poll.Reset(PollInterval)
	switch {
	case exists && (!existed || id.Key() != prev.Key()):
		return Created
	case exists && id != prev:
		return Changed | Lost // its attributes changed, or a new file got the inode back
	case !exists && existed:
		return Changed
	}
	return 0
}

// lookPattern is look for a pattern: it reports Created when the matching files differ from
// the last look (one appeared, went or was created anew), which the owner looks at itself.
func (s *Subscription) lookPattern(watchErr error) Change {
	var set strings.Builder
	for _, e := range MatchingEntries(s.dir, s.name) {
		id, _, _ := fsid.Stat(filepath.Join(s.dir, e.Name()))
		fmt.Fprintf(&set, "%s %v\n", e.Name(), id)
	}
	prev := s.seenSet
	s.seenSet = set.String()
	if s.poll == nil {
		s.startPoll(watchErr)
		return Lost
	}
	s.poll.Reset(PollInterval)
	if s.seenSet != prev {
		return Created | Changed
	}
	return 0
}

// MatchingEntries lists the files of dir whose names match pattern (path/filepath.Match); dir
// is taken as it is written, whatever bytes it holds. A directory that cannot be read has none.
func MatchingEntries(dir, pattern string) []fs.DirEntry {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil
	}
	return slices.DeleteFunc(entries, func(e fs.DirEntry) bool {
		ok, _ := filepath.Match(pattern, e.Name()) // the only error is a malformed pattern, refused by config
		return !ok
	})
}

// startPoll starts the looks, while inotify refuses the watch s needs. The first to start
// says why, once for every path that follows (each is named at debug level). opsMu is held.
func (s *Subscription) startPoll(watchErr error) {
	if errors.Is(watchErr, syscall.ENOSPC) {
		watchErr = fmt.Errorf("%w: inotify's watch limit is reached (sysctl fs.inotify.max_user_watches)", watchErr)
	}
	if s.w.polling == 0 {
		s.w.log.Warn("cannot watch a file's directory; looking at such files every "+PollInterval.String()+
			" instead, this one and any other inotify refuses, until it watches them all again", "path", s.path, "err", watchErr)
	} else {
		s.w.log.Debug("cannot watch a file's directory; looking at the file every "+PollInterval.String(), "path", s.path, "err", watchErr)
	}
	s.w.polling++
	s.poll = time.AfterFunc(PollInterval, func() { s.kick(mend) })
}

// pollEnded counts a subscription that stopped looking for itself. opsMu is held.
func (w *Watcher) pollEnded() {
	w.polling--
	if w.polling == 0 {
		w.log.Info("watching every file's directory again: inotify accepts the watches")
	}
}

// newError says why an inotify instance could not be had. inotify_init1 fails with EMFILE
// for the per-user limit on instances as for the process's descriptors: a descriptor the
// process can still open tells the first.
func newError(err error) error {
	if !errors.Is(err, syscall.EMFILE) {
		return fmt.Errorf("create an inotify instance: %w", err)
	}
	if f, oerr := os.Open(os.DevNull); oerr == nil {
		f.Close()
		return fmt.Errorf("create an inotify instance: inotify's limit on instances per user is reached (sysctl fs.inotify.max_user_instances; every process of the user counts, on the whole node for root): %w", err)
	}
	return fmt.Errorf("create an inotify instance: the process has no file descriptor left (RLIMIT_NOFILE): %w", err)
}
