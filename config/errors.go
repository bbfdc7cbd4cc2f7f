package config

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// errList collects every problem in a file, each as "path: value: message" on one line,
// and reports them in the order of the file's fields. A field that failed to decode is not
// validated again: its zero value would only produce a second, misleading error.
type errList struct {
	entries []entry
	failed  map[string]bool
}

type entry struct {
	path string
	err  error
}

// add records an error at path, unless decoding that path already failed.
func (l *errList) add(path, msg string) {
	if l.failed[path] {
		return
	}
	if path == "" {
		l.entries = append(l.entries, entry{err: errors.New(msg)})
		return
	}
	l.entries = append(l.entries, entry{path, fmt.Errorf("%s: %s", path, msg)})
}

// addValue records an error at path that shows the offending value.
func (l *errList) addValue(path string, value any, msg string) {
	l.add(path, formatValue(value)+": "+msg)
}

// addf is addValue with a formatted message.
func (l *errList) addf(path string, value any, format string, args ...any) {
	l.addValue(path, value, fmt.Sprintf(format, args...))
}

// decodeFailed records that the value at path could not be decoded.
func (l *errList) decodeFailed(path string, value any, msg string) {
	if path == "" {
		l.add("", "top level: "+formatValue(value)+": "+msg)
		return
	}
	l.addValue(path, value, msg)
	if l.failed == nil {
		l.failed = map[string]bool{}
	}
	l.failed[path] = true
}

// addYAML records a YAML syntax or duplicate-key error; each carries its line number.
func (l *errList) addYAML(err error) {
	msg := err.Error()
	if rest, ok := strings.CutPrefix(msg, "yaml: unmarshal errors:\n"); ok {
		for _, line := range strings.Split(rest, "\n") {
			if line = strings.TrimSpace(line); line != "" {
				l.entries = append(l.entries, entry{err: errors.New("yaml: " + line)})
			}
		}
		return
	}
	l.entries = append(l.entries, entry{err: errors.New(strings.ReplaceAll(msg, "\n", " "))})
}

// err returns every problem joined, one per line, in file order: the top-level fields as
// the schema lists them, then each driver by index.
func (l *errList) err() error {
	slices.SortStableFunc(l.entries, func(a, b entry) int {
		ra, ia := position(a.path)
		rb, ib := position(b.path)
		return cmp.Or(cmp.Compare(ra, rb), cmp.Compare(ia, ib))
	})
	errs := make([]error, len(l.entries))
	for i, e := range l.entries {
		errs[i] = e.err
	}
	return errors.Join(errs...)
}

var topLevelOrder = []string{"", "apiVersion", "kind", "registrationDir", "defaults", "drivers"}

// position is where a field path stands in the file: its top-level field's rank and, for
// drivers, the index.
func position(path string) (rank, index int) {
	top := path
	if i := strings.IndexAny(path, ".["); i >= 0 {
		top = path[:i]
	}
	rank = slices.Index(topLevelOrder, top)
	if rank < 0 {
		rank = len(topLevelOrder)
	}
	if rest, ok := strings.CutPrefix(path, "drivers["); ok {
		if end := strings.IndexByte(rest, ']'); end > 0 {
			index, _ = strconv.Atoi(rest[:end])
		}
	}
	return rank, index
}
