package config

import (
	"errors"
	"fmt"
	"io"
	"os"
)

// Load reads and parses the drivers file at path. See ReadFile and Parse. Every error line
// starts with the path.
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
	cfg, err := Parse(b)
	if err != nil {
		return nil, nil, prefixEach(path, err)
	}
	return cfg, b, nil
}

// prefixEach puts the file's path in front of each of the joined errors in err.
func prefixEach(path string, err error) error {
	joined, ok := err.(interface{ Unwrap() []error })
	if !ok {
		return fmt.Errorf("%s: %w", path, err)
	}
	var errs []error
	for _, e := range joined.Unwrap() {
		errs = append(errs, fmt.Errorf("%s: %w", path, e))
	}
	return errors.Join(errs...)
}

// ReadFile reads the drivers file at path. A file over MaxFileSize is refused without being
// read whole.
func ReadFile(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("read config: %w", err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, MaxFileSize+1))
	if err != nil {
		return nil, fmt.Errorf("read config %s: %w", path, err)
	}
	if len(b) > MaxFileSize {
		return nil, fmt.Errorf("read config %s: larger than %d bytes (1 MiB), the most a drivers file may be", path, MaxFileSize)
	}
	return b, nil
}

// Parse decodes a drivers file strictly, validates it and resolves every default.
// The error lists every problem found, one per line, each with its field path and value.
func Parse(b []byte) (*RegistrarConfig, error) {
	if len(b) > MaxFileSize {
		return nil, fmt.Errorf("config is %d bytes, larger than %d bytes (1 MiB), the most a drivers file may be", len(b), MaxFileSize)
	}
	var errs errList
	f := decode(b, &errs)
	if f == nil {
		return nil, errs.err()
	}
	cfg := resolve(f, &errs)
	if err := errs.err(); err != nil {
		return nil, err
	}
	return cfg, nil
}
