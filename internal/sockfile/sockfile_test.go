package sockfile

import (
	"errors"
	"net"
	"os"
	"path/filepath"
	"testing"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/testkit"
)

// TestPublishNeverReplacesWhatAppears: a non-socket that appears at the path between the
// check and the rename is put back untouched.
func TestPublishNeverReplacesWhatAppears(t *testing.T) {
	for _, exists := range []bool{false, true} {
		dir := testkit.ShortDir(t)
		tmp, path := filepath.Join(dir, TempName()), filepath.Join(dir, "x-reg.sock")
		l, err := testkit.ListenUnlinked(tmp)
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		if err := os.WriteFile(path, []byte("precious"), 0o644); err != nil {
			t.Fatal(err)
		}
		err = renameOnto(tmp, path, exists)
		if _, ok := errors.AsType[*NotSocketError](err); !ok {
			t.Errorf("exists=%v: renameOnto over a file: %v, want a not-a-socket error", exists, err)
		}
		if b, err := os.ReadFile(path); err != nil || string(b) != "precious" {
			t.Errorf("exists=%v: the file: %q, %v", exists, b, err)
		}
		if !testkit.IsSocket(tmp) {
			t.Errorf("exists=%v: our socket is not back under its temporary name", exists)
		}
	}
}

// TestPublishRemovedAsPublished: a socket removed between its rename and the look after it is
// published again at once, served by a second call of serve after the first one's undo; removed
// again, it is the caller's error, and nothing is left in the directory.
func TestPublishRemovedAsPublished(t *testing.T) {
	for _, removals := range []int{1, 2} {
		dir := testkit.ShortDir(t)
		path := filepath.Join(dir, "x-reg.sock")
		removed := 0
		afterRename = func(p string) {
			if removed < removals {
				removed++
				if err := os.Remove(p); err != nil {
					t.Error(err)
				}
			}
		}
		var served, undone int
		l, id, err := Publish(path, func(*net.UnixListener) (func(), error) {
			served++
			return func() { undone++ }, nil
		})
		afterRename = func(string) {}
		if removals == 1 {
			if err != nil {
				t.Fatalf("removed once: %v", err)
			}
			defer l.Close()
			got, _, err := fsid.Stat(path)
			if err != nil || got != id {
				t.Errorf("removed once: the socket at %s: %v, %v; want %v", path, got, err, id)
			}
			if c, err := net.Dial("unix", path); err != nil {
				t.Errorf("removed once: the socket published again does not accept: %v", err)
			} else {
				c.Close()
			}
			if served != 2 || undone != 1 {
				t.Errorf("removed once: served %d times, undone %d; want 2, 1", served, undone)
			}
			continue
		}
		if !errors.Is(err, errRemovedAsPublished) || l != nil {
			t.Errorf("removed twice: %v, %v; want the error %q", l, err, errRemovedAsPublished)
		}
		if served != 2 || undone != 2 {
			t.Errorf("removed twice: served %d times, undone %d; want 2, 2", served, undone)
		}
		if left, _ := os.ReadDir(dir); len(left) != 0 {
			t.Errorf("removed twice: left in the directory: %v", left)
		}
	}
}

func TestTempSocketNames(t *testing.T) {
	n := TempName()
	if len(n) != config.TempSocketNameLen || !IsTempName(n) {
		t.Errorf("TempName() = %q (%d bytes), want %d bytes and recognized", n, len(n), config.TempSocketNameLen)
	}
	for _, name := range []string{".mr-0123abcg.tmp", ".mr-0123abc.tmp", "mr-0123abcd.tmp", ".mr-0123abcd.sock"} {
		if IsTempName(name) {
			t.Errorf("%q taken for a temporary socket", name)
		}
	}
}
