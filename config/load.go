package config

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"strings"
	"syscall"
)

// Load reads and parses the drivers file at path. See ReadFile and ParseLocal. Every error
// line starts with the path.
func Load(path string) (*RegistrarConfig, error) {
	cfg, _, err := LoadContent(path)
	return cfg, err
}

// LoadContent is Load that also returns the content it parsed.
func LoadContent(path string) (*RegistrarConfig, []byte, error) {
	b, err := ReadFile(path)
	if err != nil {
		return nil, nil, err
	}
	cfg, err := ParseLocal(b)
	if err != nil {
		// Every line of the error starts with the path.
		return nil, nil, errors.New(path + ": " + strings.ReplaceAll(err.Error(), "\n", "\n"+path+": "))
	}
	return cfg, b, nil
}

// ReadFile reads the drivers file at path, following symlinks. Anything but a regular file
// (a named pipe, a device, a directory, a socket) is refused without blocking: opening a
// named pipe waits for a writer, and reading a device may never end. A file over MaxFileSize
// is refused without being read whole.
func ReadFile(path string) ([]byte, error) {
	return readFile(path, MaxFileSize, "(1 MiB), the most a drivers file may be")
}

// ReadInput reads what `multireg validate` checks: standard input for "-" (stdin), or the
// file at path, each up to MaxManifestSize, as it may be a stream of manifests (see Extract).
// Besides a regular file, path may be a named pipe or a character device, read like standard
// input: `-f <(helm template …)` and `-f /dev/stdin` (opening a named pipe waits for its
// writer, as cat does). A directory, a socket or a block device is refused, naming the path.
func ReadInput(path string, stdin io.Reader) ([]byte, error) {
	const why = "(16 MiB), the most multireg validate reads"
	if path == "-" {
		return readLimited(stdin, "standard input", MaxManifestSize, why)
	}
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOCTTY, 0)
	if errors.Is(err, syscall.ENXIO) {
		// A unix socket cannot be opened at all.
		if fi, serr := os.Stat(path); serr == nil && !fi.Mode().IsRegular() {
			return nil, notReadable(path, fi.Mode())
		}
	}
	if err != nil {
		return nil, fmt.Errorf("read config: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("read config %s: %w", path, err)
	}
	if m := fi.Mode(); !m.IsRegular() && m.Type() != fs.ModeNamedPipe && m.Type() != fs.ModeDevice|fs.ModeCharDevice {
		return nil, notReadable(path, m)
	}
	return readLimited(f, "config "+path, MaxManifestSize, why)
}

// notReadable is ReadInput's error for a path it does not read.
func notReadable(path string, mode fs.FileMode) error {
	return fmt.Errorf("read config %s: is %s: give a file or a pipe holding a drivers file or manifests, or - for standard input", path, fileType(mode))
}

// readLimited reads r whole, refusing it once it is over limit bytes.
func readLimited(r io.Reader, name string, limit int, why string) ([]byte, error) {
	b, err := io.ReadAll(io.LimitReader(r, int64(limit)+1))
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", name, err)
	}
	if len(b) > limit {
		return nil, fmt.Errorf("read %s: larger than %d bytes %s", name, limit, why)
	}
	return b, nil
}

func readFile(path string, limit int, why string) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK|syscall.O_NOCTTY, 0)
	if errors.Is(err, syscall.ENXIO) {
		// A unix socket cannot be opened at all.
		if fi, serr := os.Stat(path); serr == nil && !fi.Mode().IsRegular() {
			return nil, notRegular(path, fi.Mode())
		}
	}
	if err != nil {
		return nil, fmt.Errorf("read config: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("read config %s: %w", path, err)
	}
	if !fi.Mode().IsRegular() {
		return nil, notRegular(path, fi.Mode())
	}
	b, err := io.ReadAll(io.LimitReader(f, int64(limit)+1))
	if err != nil {
		return nil, fmt.Errorf("read config %s: %w", path, err)
	}
	if len(b) > limit {
		return nil, fmt.Errorf("read config %s: larger than %d bytes %s", path, limit, why)
	}
	return b, nil
}

// notRegular is the error for a drivers file that is not a regular file.
func notRegular(path string, mode fs.FileMode) error {
	return fmt.Errorf("read config %s: is %s, not a regular file", path, fileType(mode))
}

// fileType names the type of a file that is not a regular one.
func fileType(mode fs.FileMode) string {
	what, ok := map[fs.FileMode]string{
		fs.ModeNamedPipe: "a named pipe (FIFO)", fs.ModeDevice | fs.ModeCharDevice: "a character device",
		fs.ModeDevice: "a block device", fs.ModeDir: "a directory", fs.ModeSocket: "a unix socket",
	}[mode.Type()]
	if !ok {
		return fmt.Sprintf("of mode %s", mode)
	}
	return what
}

// Parse decodes a drivers file strictly, validates it and resolves every default.
// The error lists every problem found, one per line, each with its field path and value.
// It reads nothing but b: what only this machine's filesystem shows is ParseLocal's.
func Parse(b []byte) (*RegistrarConfig, error) {
	return parse(b, nil)
}

// ParseLocal is Parse, and also refuses a device plugin whose endpoint's directory is kubelet's
// device-plugin directory through a symlink or a mount, as far as this machine shows it (see
// KubeletDevicePluginDir). multireg run (Load, and every reload) and multireg validate parse
// with it, so that both say the same of the same file on the same machine.
func ParseLocal(b []byte) (*RegistrarConfig, error) {
	return parse(b, os.Stat)
}

// parse is Parse, looking at this machine's paths with look when it is not nil.
func parse(b []byte, look func(string) (fs.FileInfo, error)) (*RegistrarConfig, error) {
	if len(b) > MaxFileSize {
		return nil, fmt.Errorf("config is %d bytes, larger than %d bytes (1 MiB), the most a drivers file may be", len(b), MaxFileSize)
	}
	f, failed, errs := decode(b)
	if f != nil {
		cfg, verrs := resolve(f, look)
		for _, e := range verrs {
			if !failed[e.Field] {
				errs = append(errs, e)
			}
		}
		if len(errs) == 0 {
			return cfg, nil
		}
	}
	return nil, joined(errs)
}
