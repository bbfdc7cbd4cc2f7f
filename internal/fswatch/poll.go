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

// dirPollInterval paces the look at a file for which inotify refuses every watch (its watch
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

// lookPattern is look for a pattern: it reports evCreated when the matching files differ from
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

// startPoll starts the looks, while inotify refuses the watch s needs, and says why.
func (s *Subscription) startPoll(watchErr error) {
	if errors.Is(watchErr, syscall.ENOSPC) {
		watchErr = fmt.Errorf("%w: inotify's watch limit is reached (sysctl fs.inotify.max_user_watches)", watchErr)
	}
	s.w.log.Warn("cannot watch a file's directory; looking at the file every "+PollInterval.String(), "path", s.path, "err", watchErr)
	s.poll = time.AfterFunc(PollInterval, func() { s.kick(mend) })
}
