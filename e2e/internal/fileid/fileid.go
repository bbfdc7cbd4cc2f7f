// Package fileid tells files apart: a file created anew at the same path (a socket recreated,
// a directory swapped) has another identity, even when the kernel reuses its inode number.
package fileid

import "syscall"

// ID identifies a file: a file created anew at the same path differs in inode or change time
// (an inode number alone is often reused at once for a socket created anew).
type ID struct {
	Ino   uint64
	Ctime syscall.Timespec
}

// Of returns the identity of the file at path (not followed if a symlink), the zero ID if
// there is none.
func Of(path string) ID {
	var st syscall.Stat_t
	if err := syscall.Lstat(path, &st); err != nil {
		return ID{}
	}
	return ID{Ino: st.Ino, Ctime: st.Ctim}
}
