//go:build linux

package main

import (
	"bytes"
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/regdir"
	"multireg.dev/multireg/internal/testkit"
)

func writeConfig(t *testing.T, dir, body string) string {
	t.Helper()
	p := filepath.Join(dir, "drivers.yaml")
	if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestRunRegistersAndStops(t *testing.T) {
	dir, err := os.MkdirTemp("", "mr")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	reg := filepath.Join(dir, "reg")
	cfg := writeConfig(t, dir, `apiVersion: multireg.dev/v1alpha1
kind: RegistrarConfig
registrationDir: `+reg+`
defaults: {waitForEndpoint: false}
drivers:
  - {name: vendor.example/gpu, type: DevicePlugin, endpoint: /run/gpu/dp.sock}
  - {name: gpu.example.com, type: DRAPlugin, endpoint: /run/gpu/dra.sock}
`)
	for _, cleanup := range []bool{false, true} {
		ctx, cancel := context.WithCancel(context.Background())
		var logs testkit.Buffer
		done := make(chan error, 1)
		args := []string{"run", "--config", cfg, "--log-format", "json"}
		if cleanup {
			args = append(args, "--cleanup-on-exit")
		}
		go func() { done <- run(ctx, args, nil, &logs, &logs) }()
		// Each driver's registration paths: a DRA driver registered again goes to the one
		// kubelet does not hold.
		socks := [][]string{
			{filepath.Join(reg, "vendor.example_gpu-reg.sock")},
			{filepath.Join(reg, "gpu.example.com-reg.sock"), filepath.Join(reg, "gpu.example.com-reg.1.sock")},
		}
		// The first run leaves its sockets; wait for this run's own.
		before := map[string]os.FileInfo{}
		for _, s := range slices.Concat(socks...) {
			if fi, err := os.Lstat(s); err == nil {
				before[s] = fi
			}
		}
		published := func(paths []string) bool {
			for _, s := range paths {
				fi, err := os.Lstat(s)
				if err == nil && fi.Mode().Type() == os.ModeSocket && (before[s] == nil || !os.SameFile(fi, before[s])) {
					return true
				}
			}
			return false
		}
		testkit.Eventually(t, 10*time.Second, "both drivers' sockets published by this run", func() bool {
			return published(socks[0]) && published(socks[1])
		})
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("run returned %v", err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("run did not stop within 5s")
		}
		for _, paths := range socks {
			left := 0
			for _, s := range paths {
				if _, err := os.Lstat(s); err == nil {
					left++
				}
			}
			if want := map[bool]int{false: 1, true: 0}[cleanup]; left != want {
				t.Errorf("cleanup %v: %d sockets left at %v, want %d", cleanup, left, paths, want)
			}
		}
		if !strings.Contains(logs.String(), `"msg":"multireg started"`) {
			t.Errorf("no JSON start line in the logs:\n%s", logs.String())
		}
	}
}

func TestRunRefusesInvalidConfig(t *testing.T) {
	cfg := writeConfig(t, t.TempDir(), "apiVersion: multireg.dev/v1alpha1\nkind: RegistrarConfig\ndrivers:\n  - name: x\n")
	err := run(context.Background(), []string{"run", "--config", cfg}, nil, &bytes.Buffer{}, &bytes.Buffer{})
	if err == nil || exitCode(err) != 1 {
		t.Fatalf("run with an invalid config: %v, want exit 1", err)
	}
	for _, want := range []string{"drivers[0].type: required", "drivers[0].endpoint: required"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q lacks %q", err, want)
		}
	}
	if err := run(context.Background(), []string{"run", "--config", cfg, "--log-format", "xml"}, nil, &bytes.Buffer{}, &bytes.Buffer{}); exitCode(err) != 2 {
		t.Errorf("--log-format xml: %v, want a usage error", err)
	}
}

// TestRunAndValidateRefuseDevicePluginDir: a device plugin whose endpoint is in kubelet's
// device-plugin directory, by name or through a symlink to the device-plugins directory under
// registrationDir's root, makes the file invalid: multireg validate and multireg run at start
// say so alike, exit 1.
func TestRunAndValidateRefuseDevicePluginDir(t *testing.T) {
	top := testkit.ShortDir(t)
	reg := filepath.Join(top, "root", "plugins_registry")
	dp := filepath.Join(top, "root", "device-plugins")
	for _, d := range []string{reg, dp} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	link := filepath.Join(top, "link")
	if err := os.Symlink(dp, link); err != nil {
		t.Fatal(err)
	}
	linked := writeConfig(t, t.TempDir(), "apiVersion: multireg.dev/v1alpha1\nkind: RegistrarConfig\nregistrationDir: "+reg+
		"\ndrivers:\n  - {name: example.com/x, type: DevicePlugin, endpoint: "+link+"/x.sock}\n")
	for file, want := range map[string]string{
		filepath.Join("..", "..", "config", "testdata", "invalid-device-plugin-dir.yaml"): `drivers[0].endpoint: "/var/lib/kubelet/device-plugins/nvidia-gpu.sock": is in kubelet's device-plugin directory /var/lib/kubelet/device-plugins, `,
		linked: `drivers[0].endpoint: "` + link + `/x.sock": is in ` + link + `, the same directory here as ` + dp + `, `,
	} {
		var out bytes.Buffer
		verr := run(context.Background(), []string{"validate", "--config", file}, nil, &out, &bytes.Buffer{})
		if verr == nil || exitCode(verr) != 1 || !strings.HasPrefix(verr.Error(), file+": "+want) || strings.Contains(verr.Error(), "\n") {
			t.Errorf("validate %s: %v (exit %d), want exit 1 with one line starting %q", file, verr, exitCode(verr), file+": "+want)
		}
		if out.Len() != 0 {
			t.Errorf("validate %s printed %q", file, out.String())
		}
		// Bounded, should it start: refused, it returns at once.
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		rerr := run(ctx, []string{"run", "--config", file, "--http-endpoint", ""}, nil, &bytes.Buffer{}, &bytes.Buffer{})
		cancel()
		if rerr == nil || exitCode(rerr) != 1 || verr == nil || rerr.Error() != verr.Error() {
			t.Errorf("run %s: %v (exit %d), want exit 1 with what validate says", file, rerr, exitCode(rerr))
		}
	}
	if entries, _ := os.ReadDir(reg); len(entries) != 0 {
		t.Errorf("run with an invalid file left %d files in the registration directory", len(entries))
	}
}

// startRun runs `multireg run` with args in the background until the test ends, and returns
// its log once it has started.
func startRun(t *testing.T, args ...string) *testkit.Buffer {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var logs testkit.Buffer
	done := make(chan error, 1)
	go func() { done <- run(ctx, append([]string{"run", "--http-endpoint", ""}, args...), nil, &logs, &logs) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("run returned %v", err)
		}
	})
	testkit.Eventually(t, 10*time.Second, "multireg to start", func() bool { return strings.Contains(logs.String(), "multireg started") })
	return &logs
}

const twoDrivers = `
defaults: {waitForEndpoint: false}
drivers:
  - {name: vendor.example/gpu, type: DevicePlugin, endpoint: /run/gpu/dp.sock}
  - {name: gpu.example.com, type: DRAPlugin, endpoint: /run/gpu/dra.sock}
`

// TestRunChecksFlagsFirst: a malformed --http-endpoint is a usage error (exit 2), found
// before the drivers file is read or the registration directory is waited for.
func TestRunChecksFlagsFirst(t *testing.T) {
	dir := t.TempDir()
	reg := filepath.Join(dir, "reg")
	held, err := holdDir(reg)
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	cfg := writeConfig(t, dir, "apiVersion: multireg.dev/v1alpha1\nkind: RegistrarConfig\nregistrationDir: "+reg+twoDrivers)
	for _, addr := range []string{"localhost", "127.0.0.1:99999", "127.0.0.1:no-such-service", "[::1"} {
		var logs testkit.Buffer
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err := run(ctx, []string{"run", "--config", cfg, "--http-endpoint", addr}, nil, &logs, &logs)
		cancel()
		if exitCode(err) != 2 || !strings.Contains(err.Error(), "--http-endpoint") || !strings.Contains(err.Error(), addr) {
			t.Errorf("--http-endpoint %q: %v, want a usage error naming it", addr, err)
		}
		if logs.String() != "" {
			t.Errorf("--http-endpoint %q: it went on before failing:\n%s", addr, logs.String())
		}
	}
}

// TestRunMovesToAnotherNameOfItsDirectory: registrationDir changed to a symlink of the
// directory this very process holds is applied, not blamed on "another multireg".
func TestRunMovesToAnotherNameOfItsDirectory(t *testing.T) {
	dir := testkit.ShortDir(t)
	reg := filepath.Join(dir, "reg")
	alias := filepath.Join(dir, "alias")
	if err := os.Symlink("reg", alias); err != nil {
		t.Fatal(err)
	}
	header := "apiVersion: multireg.dev/v1alpha1\nkind: RegistrarConfig\nregistrationDir: "
	cfg := writeConfig(t, dir, header+reg+twoDrivers)
	logs := startRun(t, "--config", cfg)
	writeConfig(t, dir, header+alias+twoDrivers)
	testkit.Eventually(t, 10*time.Second, "the new registrationDir to be applied", func() bool { return strings.Contains(logs.String(), "config reloaded") })
	if strings.Contains(logs.String(), "config not applied") {
		t.Errorf("the change was refused:\n%s", logs.String())
	}
}

// TestRunRetriesTheOwnedRecord: a record of the owned sockets that cannot be written is
// written once the directory lets it.
func TestRunRetriesTheOwnedRecord(t *testing.T) {
	dir := testkit.ShortDir(t)
	reg := filepath.Join(dir, "reg")
	header := "apiVersion: multireg.dev/v1alpha1\nkind: RegistrarConfig\nregistrationDir: " + reg
	cfg := writeConfig(t, dir, header+twoDrivers)
	logs := startRun(t, "--config", cfg)
	// The first record is written at start, through the same temporary file: the blocker goes
	// in once it is done, or it would race with it.
	testkit.Eventually(t, 10*time.Second, "the first record written", func() bool {
		b, _ := os.ReadFile(filepath.Join(reg, regdir.OwnedName))
		return strings.Contains(string(b), "gpu.example.com-reg.sock")
	})
	// A directory where the record's temporary file goes makes every write fail (root
	// writes through a read-only mode, so the mode cannot do it).
	blocker := filepath.Join(reg, regdir.OwnedName+".tmp")
	if err := os.Mkdir(blocker, 0o700); err != nil {
		t.Fatal(err)
	}
	writeConfig(t, dir, header+twoDrivers+"  - {name: extra.example.com, type: DRAPlugin, endpoint: /run/x/dra.sock}\n")
	testkit.Eventually(t, 10*time.Second, "the failed record to be reported", func() bool { return strings.Contains(logs.String(), "retrying") })
	if err := os.Remove(blocker); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 10*time.Second, "the record to be written again", func() bool {
		b, _ := os.ReadFile(filepath.Join(reg, regdir.OwnedName))
		return strings.Contains(string(b), "extra.example.com-reg.sock")
	})
}

// TestRunRetriesARefusedMove: a registrationDir move refused while another instance holds
// the new directory is applied by the next SIGHUP once that instance has let it go.
func TestRunRetriesARefusedMove(t *testing.T) {
	dir := testkit.ShortDir(t)
	header := "apiVersion: multireg.dev/v1alpha1\nkind: RegistrarConfig\nregistrationDir: "
	cfg := writeConfig(t, dir, header+filepath.Join(dir, "a")+twoDrivers)
	other, err := holdDir(filepath.Join(dir, "b"))
	if err != nil {
		t.Fatal(err)
	}
	logs := startRun(t, "--config", cfg)
	writeConfig(t, dir, header+filepath.Join(dir, "b")+twoDrivers)
	testkit.Eventually(t, 10*time.Second, "the move to be refused", func() bool { return strings.Contains(logs.String(), "config not applied") })
	other.Close()
	if err := syscall.Kill(os.Getpid(), syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 10*time.Second, "the move to be applied after SIGHUP", func() bool {
		return isSocket(filepath.Join(dir, "b", "gpu.example.com-reg.sock"))
	})
}

// holdDir holds the registration directory dir as another instance would.
func holdDir(dir string) (*regdir.Dir, error) {
	d, _, err := regdir.Open(context.Background(), &config.RegistrarConfig{RegistrationDir: dir}, slog.New(slog.DiscardHandler), regdir.Options{})
	return d, err
}

func isSocket(path string) bool {
	fi, err := os.Lstat(path)
	return err == nil && fi.Mode().Type() == os.ModeSocket
}

// TestLocalExampleAsWritten follows examples/local/config.yaml's own instructions, with its
// /tmp/multireg-demo moved to a temporary directory: every command before `multireg run`
// (the mkdir of the registry's parent), then run, which must publish a socket per driver.
func TestLocalExampleAsWritten(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "..", "examples", "local", "config.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "mr")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	const prefix = "/tmp/multireg-demo"
	moved := strings.ReplaceAll(string(b), prefix, filepath.Join(dir, "demo"))
	for _, l := range strings.Split(moved, "\n") {
		cmd, ok := strings.CutPrefix(l, "#   ")
		if !ok {
			continue
		}
		cmd, _, _ = strings.Cut(cmd, "#")
		f := strings.Fields(cmd)
		if len(f) > 0 && f[0] == "multireg" {
			break
		}
		if len(f) != 3 || f[0] != "mkdir" || f[1] != "-p" {
			t.Fatalf("a command before multireg run that this test does not follow: %q", cmd)
		}
		if err := os.MkdirAll(f[2], 0o755); err != nil {
			t.Fatal(err)
		}
	}
	cfg := writeConfig(t, dir, moved)
	parsed, err := config.Load(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var logs testkit.Buffer
	done := make(chan error, 1)
	go func() { done <- run(ctx, []string{"run", "--config", cfg, "--http-endpoint", ""}, nil, &logs, &logs) }()
	testkit.Eventually(t, 10*time.Second, "a socket per driver", func() bool {
		select {
		case err := <-done:
			t.Fatalf("run ended: %v\n%s", err, logs.String())
		default:
		}
		for _, d := range parsed.Drivers {
			if fi, err := os.Lstat(filepath.Join(parsed.RegistrationDir, d.SocketName)); err != nil || fi.Mode().Type() != os.ModeSocket {
				return false
			}
		}
		return true
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestIdleStaysIdleAfterItsSuccessorStops: after a hand-over, a clean stop of the successor
// (SIGTERM: outside Kubernetes, `systemctl stop` of the new unit) leaves the idle predecessor
// idle: it does not take the directory back. (A successor that crashes is another matter: the
// idle one takes its sockets back, e2e/registration's TestHandoverKilledAtEachStep.)
func TestIdleStaysIdleAfterItsSuccessorStops(t *testing.T) {
	dir := testkit.ShortDir(t)
	reg := filepath.Join(dir, "reg")
	cfg := writeConfig(t, dir, `apiVersion: multireg.dev/v1alpha1
kind: RegistrarConfig
registrationDir: `+reg+`
defaults: {waitForEndpoint: false}
drivers:
  - {name: vendor.example/gpu, type: DevicePlugin, endpoint: /run/gpu/dp.sock}
`)
	sock := filepath.Join(reg, "vendor.example_gpu-reg.sock")
	const serving = "serving the registration directory"
	start := func(logs *testkit.Buffer) (stop func() error) {
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- run(ctx, []string{"run", "--config", cfg, "--http-endpoint", ""}, nil, logs, logs) }()
		return func() error {
			cancel()
			select {
			case err := <-done:
				return err
			case <-time.After(10 * time.Second):
				t.Fatal("run did not stop within 10s")
				return nil
			}
		}
	}
	var first, second testkit.Buffer
	stopFirst := start(&first)
	testkit.Eventually(t, 10*time.Second, "the first instance serving", func() bool { return strings.Contains(first.String(), serving) })
	testkit.Eventually(t, 10*time.Second, "its socket", func() bool { _, err := os.Lstat(sock); return err == nil })
	stopSecond := start(&second)
	testkit.Eventually(t, 10*time.Second, "the second instance serving", func() bool { return strings.Contains(second.String(), serving) })
	testkit.Eventually(t, 10*time.Second, "the first instance idle", func() bool { return strings.Contains(first.String(), "handed over") })
	before, err := os.Lstat(sock)
	if err != nil {
		t.Fatal(err)
	}

	if err := stopSecond(); err != nil {
		t.Fatalf("the second instance: %v", err)
	}
	// An idle instance would take the lock within lockRetry of the successor's exit.
	testkit.Never(t, 2*time.Second, "the idle instance serving again", func() bool { return strings.Count(first.String(), serving) > 1 })
	if !strings.Contains(first.String(), "the successor was stopped cleanly") {
		t.Errorf("the idle instance does not say why it stays idle:\n%s", first.String())
	}
	if fi, err := os.Lstat(sock); err != nil || !os.SameFile(fi, before) {
		t.Errorf("the socket after the successor's stop: %v, want the one it served, left in place", err)
	}
	if err := stopFirst(); err != nil {
		t.Fatalf("the idle instance: %v", err)
	}
	if fi, err := os.Lstat(sock); err != nil || !os.SameFile(fi, before) {
		t.Errorf("the socket after the idle instance's stop: %v, want it untouched", err)
	}
}
