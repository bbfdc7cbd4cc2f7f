package sockfile

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"multireg.dev/multireg/config"
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
