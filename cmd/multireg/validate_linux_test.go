//go:build linux

package main

import (
	"bytes"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"multireg.dev/multireg/config"
)

const validDrivers = "apiVersion: multireg.dev/v1alpha1\nkind: RegistrarConfig\ndrivers:\n  - {name: nfs.csi.k8s.io, type: CSIPlugin, endpoint: /var/lib/kubelet/plugins/nfs/csi.sock}\n"

const validSummary = ": valid: 1 driver (1 CSIPlugin) in /var/lib/kubelet/plugins_registry\n"

// writeFIFO writes b to the FIFO at path in a goroutine. The function it returns, called once
// the reader is done, returns what the write returned. A writer the reader left waiting (it
// refused the FIFO, or read only part) is let through: readers that read nothing open and
// close the FIFO until the writer returns (EPIPE, when it has more to write).
func writeFIFO(t *testing.T, path string, b []byte) (wait func() error) {
	t.Helper()
	done := make(chan error, 1)
	go func() {
		w, err := os.OpenFile(path, os.O_WRONLY, 0)
		if err != nil {
			done <- err
			return
		}
		_, err = w.Write(b)
		w.Close()
		done <- err
	}()
	return func() error {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for time.Now().Before(deadline) {
			r, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
			if err != nil {
				t.Fatal(err)
			}
			select {
			case err := <-done:
				r.Close()
				return err
			case <-time.After(10 * time.Millisecond):
				r.Close()
			}
		}
		t.Fatalf("the writer of %s had not returned after 10s", path)
		return nil
	}
}

// TestValidateReadsFIFO: a named pipe is read like standard input (its opening waits for the
// writer, as cat's does), also through a symlink; so is a pipe's /dev/fd/N, what bash's
// -f <(helm template …) gives.
func TestValidateReadsFIFO(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "drivers.fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "link.yaml")
	if err := os.Symlink(fifo, link); err != nil {
		t.Fatal(err)
	}
	for _, path := range []string{fifo, link} {
		wait := writeFIFO(t, fifo, []byte(validDrivers))
		out, _, err := runArgs("validate", "-f", path)
		if want := path + validSummary; err != nil || out != want {
			t.Errorf("validate -f %s (a FIFO): %q, %v; want %q", path, out, err, want)
		}
		if err := wait(); err != nil {
			t.Errorf("the FIFO's writer: %v", err)
		}
	}

	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	go func() {
		w.Write([]byte(validDrivers))
		w.Close()
	}()
	path := "/dev/fd/" + strconv.Itoa(int(r.Fd()))
	out, _, err := runArgs("validate", "-f", path)
	if want := path + validSummary; err != nil || out != want {
		t.Errorf("validate -f %s (a pipe): %q, %v; want %q", path, out, err, want)
	}
}

// TestValidateReadsDevStdin: -f /dev/stdin reads the process's standard input, a pipe here.
func TestValidateReadsDevStdin(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	saved, err := syscall.Dup(0)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Dup3(int(r.Fd()), 0, 0); err != nil {
		t.Fatal(err)
	}
	defer func() {
		syscall.Dup3(saved, 0, 0)
		syscall.Close(saved)
	}()
	go func() {
		w.Write([]byte(validDrivers))
		w.Close()
	}()
	out, _, err := runArgs("validate", "-f", "/dev/stdin")
	if want := "/dev/stdin" + validSummary; err != nil || out != want {
		t.Errorf("validate -f /dev/stdin (a pipe): %q, %v; want %q", out, err, want)
	}
}

// TestValidateInputBound: a pipe over config.MaxManifestSize is refused, as standard input is;
// a directory and a socket are refused, naming the path.
func TestValidateInputBound(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "big.fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	// config's TestReadInputPipes reads one of exactly the bound.
	pad := bytes.Repeat([]byte("#\n"), config.MaxManifestSize/2+1)
	wait := writeFIFO(t, fifo, pad)
	_, _, err := runArgs("validate", "-f", fifo)
	if want := "read config " + fifo + ": larger than 16777216 bytes (16 MiB), the most multireg validate reads"; err == nil || err.Error() != want {
		t.Errorf("validate -f FIFO of %d bytes: %v; want %q", len(pad), err, want)
	}
	wait()

	sock := filepath.Join(dir, "s.yaml")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	for path, what := range map[string]string{dir: "a directory", sock: "a unix socket"} {
		_, _, err = runArgs("validate", "-f", path)
		if want := "read config " + path + ": is " + what + ": give a file or a pipe holding a drivers file or manifests, or - for standard input"; err == nil || err.Error() != want || exitCode(err) != 1 {
			t.Errorf("validate -f %s: %v; want %q", path, err, want)
		}
	}
}
