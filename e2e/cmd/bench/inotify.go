package main

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"sync"
	"syscall"
	"time"
	"unsafe"
)

// dirWatch times the appearance of files in one directory with inotify: a socket that
// multireg publishes (a rename onto its final name, or a bind there) is stamped when the
// event is read, microseconds after it happened on an idle machine, without polling.
// Names that start with "." (multireg's temporary names) are ignored.
type dirWatch struct {
	f    *os.File
	done chan struct{} // closed when the reader has returned

	mu       sync.Mutex
	appeared map[string][]time.Time // IN_CREATE or IN_MOVED_TO of the name, in order
	overflow bool                   // the kernel dropped events: the record is incomplete
	err      error
}

func watchDir(dir string) (*dirWatch, error) {
	fd, err := syscall.InotifyInit1(syscall.IN_CLOEXEC | syscall.IN_NONBLOCK)
	if err != nil {
		return nil, fmt.Errorf("inotify_init1: %w", err)
	}
	if _, err := syscall.InotifyAddWatch(fd, dir, syscall.IN_CREATE|syscall.IN_MOVED_TO); err != nil {
		syscall.Close(fd)
		return nil, fmt.Errorf("inotify_add_watch %s: %w", dir, err)
	}
	// A non-blocking descriptor makes a pollable *os.File: Close ends a pending Read.
	w := &dirWatch{f: os.NewFile(uintptr(fd), "inotify:"+dir), done: make(chan struct{}), appeared: map[string][]time.Time{}}
	go w.read()
	return w, nil
}

func (w *dirWatch) read() {
	defer close(w.done)
	buf := make([]byte, 256<<10)
	for {
		n, err := w.f.Read(buf)
		now := time.Now()
		if err != nil {
			if !errors.Is(err, os.ErrClosed) {
				w.mu.Lock()
				w.err = err
				w.mu.Unlock()
			}
			return
		}
		w.mu.Lock()
		for off := 0; off+syscall.SizeofInotifyEvent <= n; {
			ev := (*syscall.InotifyEvent)(unsafe.Pointer(&buf[off]))
			nameStart := off + syscall.SizeofInotifyEvent
			name := string(bytes.TrimRight(buf[nameStart:nameStart+int(ev.Len)], "\x00"))
			off = nameStart + int(ev.Len)
			if ev.Mask&syscall.IN_Q_OVERFLOW != 0 {
				w.overflow = true
				continue
			}
			if name == "" || name[0] == '.' {
				continue
			}
			w.appeared[name] = append(w.appeared[name], now)
		}
		w.mu.Unlock()
	}
}

// Close stops the watch and waits for its reader.
func (w *dirWatch) Close() {
	w.f.Close()
	<-w.done
}

// state reports an overflow or a read error: the record cannot be trusted then.
func (w *dirWatch) state() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.err != nil {
		return fmt.Errorf("inotify read: %w", w.err)
	}
	if w.overflow {
		return errors.New("inotify queue overflowed: events were lost")
	}
	return nil
}

// firstAfter returns when name first appeared at or after t, and whether it did.
func (w *dirWatch) firstAfter(name string, t time.Time) (time.Time, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, at := range w.appeared[name] {
		if !at.Before(t) {
			return at, true
		}
	}
	return time.Time{}, false
}

// allAfter reports, for names, the latest first appearance at or after t, and how many have
// appeared.
func (w *dirWatch) allAfter(names []string, t time.Time) (last time.Time, seen int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, n := range names {
		for _, at := range w.appeared[n] {
			if !at.Before(t) {
				seen++
				if at.After(last) {
					last = at
				}
				break
			}
		}
	}
	return last, seen
}
