// Package fsid names files by what they are rather than where they are: an ID tells a file
// created anew at the same path from the one before, a Key follows an inode through renames.
// Every package that must not touch a file it did not create compares these.
package fsid

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"syscall"
)

// ID identifies one file: a file created anew at the same path gets another identity, even
// when the kernel reuses the inode number, because its change time differs.
type ID struct {
	Dev, Ino uint64
	Ctime    syscall.Timespec
}

// Key is the file's device and inode, without the change time: what a rename keeps.
func (id ID) Key() Key { return Key{Dev: id.Dev, Ino: id.Ino} }

// Stat returns the identity and type of the file at path, without following a symlink.
func Stat(path string) (ID, fs.FileMode, error) {
	fi, err := os.Lstat(path)
	if err != nil {
		return ID{}, 0, err
	}
	id, err := Of(path, fi)
	if err != nil {
		return ID{}, 0, err
	}
	return id, fi.Mode().Type(), nil
}

// Of is the identity of the file at path that fi describes.
func Of(path string, fi fs.FileInfo) (ID, error) {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return ID{}, fmt.Errorf("stat %s: no unix stat", path)
	}
	return ID{Dev: st.Dev, Ino: st.Ino, Ctime: st.Ctim}, nil
}

// Key identifies a file by device and inode: a lock follows the inode, not the path.
type Key struct{ Dev, Ino uint64 }

// KeyOf is the key of the file fi describes, which must come from a stat of this system.
func KeyOf(fi fs.FileInfo) Key {
	st := fi.Sys().(*syscall.Stat_t)
	return Key{Dev: st.Dev, Ino: st.Ino}
}

// KeyAt returns the key of the file at path, following a symlink; the zero key when there is
// none.
func KeyAt(path string) (Key, error) {
	fi, err := os.Stat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return Key{}, nil
	}
	if err != nil {
		return Key{}, err
	}
	return KeyOf(fi), nil
}
