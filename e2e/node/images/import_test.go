package images

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"multireg.dev/multireg/e2e/internal/child"
	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/node/hostpaths"
)

// TestImport imports a pause image into a private containerd, as the e2e cluster does, and
// checks that containerd stores it under Ref, unpacked, and that it runs.
func TestImport(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: containerd mounts overlayfs to unpack images")
	}
	for _, bin := range []string{"containerd", "ctr"} {
		if _, err := exec.LookPath(bin); err != nil {
			t.Skipf("needs %s: %v", bin, err)
		}
	}
	address := startContainerd(t)

	dir := t.TempDir()
	im := pauseImage(t, dir)
	tarPath := filepath.Join(dir, "pause.tar")
	if err := im.WriteTarball(tarPath); err != nil {
		t.Fatal(err)
	}
	for range 2 { // a second import is harmless
		start := time.Now()
		if err := Import(t.Context(), address, "k8s.io", tarPath); err != nil {
			t.Fatal(err)
		}
		t.Logf("Import: %v", time.Since(start))
	}

	refs := strings.Fields(ctr(t, address, "images", "ls", "-q"))
	if !slices.Equal(refs, []string{im.Ref}) {
		t.Errorf("images in k8s.io: %q, want [%q]", refs, im.Ref)
	}
	// Unpacked: the layer's snapshot is named by its chain ID, the diff ID for one layer.
	img, err := tarball.ImageFromPath(tarPath, nil)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	snapshots := ctr(t, address, "snapshots", "ls")
	if chainID := cfg.RootFS.DiffIDs[0].String(); !strings.Contains(snapshots, chainID) {
		t.Errorf("snapshots:\n%s\nwant %s (the unpacked layer)", snapshots, chainID)
	}

	t.Run("run", func(t *testing.T) { runPause(t, address, im.Ref) })
}

// runPause runs ref with `ctr run` until /pause is its process, then kills it. Whether pause
// exits 0 on SIGTERM is cmd/pause's test: here a signal could arrive before it is ready.
func runPause(t *testing.T, address, ref string) {
	if _, err := exec.LookPath("runc"); err != nil {
		t.Skipf("needs runc: %v", err)
	}
	const id = "pause-e2e"
	run := exec.Command("ctr", "--address", address, "--namespace", "k8s.io", "run", "--rm", ref, id)
	run.WaitDelay = 10 * time.Second
	p, err := child.Start("ctr run", run)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Leave no shim behind, whatever failed: it would keep the rootfs mounted.
		_ = exec.Command("ctr", "--address", address, "-n", "k8s.io", "task", "kill", "-s", "SIGKILL", id).Run()
		p.Kill()
		_ = exec.Command("ctr", "--address", address, "-n", "k8s.io", "task", "delete", "-f", id).Run()
		_ = exec.Command("ctr", "--address", address, "-n", "k8s.io", "container", "delete", id).Run()
	})

	running := wait.Until(20*time.Second, 20*time.Millisecond, func() bool {
		pid := taskPID(address, id)
		if pid == "" {
			return false
		}
		exe, err := os.Readlink("/proc/" + pid + "/exe")
		return err == nil && exe == "/pause"
	})
	if !running {
		t.Fatalf("/pause is not the process of task %s after 20s; ctr run: %s", id, p.Output())
	}
	ctr(t, address, "task", "kill", "--signal", "SIGKILL", id)
	if _, err := p.Wait(20 * time.Second); err != nil { // exit code 137 after SIGKILL
		t.Fatalf("%v: %s", err, p.Output())
	}
}

// taskPID returns the host PID of the task id, or "" while it has none.
func taskPID(address, id string) string {
	out, err := exec.Command("ctr", "--address", address, "-n", "k8s.io", "task", "ls").Output()
	if err != nil {
		return ""
	}
	for line := range strings.Lines(string(out)) {
		if f := strings.Fields(line); len(f) == 3 && f[0] == id && f[2] == "RUNNING" {
			return f[1]
		}
	}
	return ""
}

// ctr runs ctr against the containerd at address in namespace k8s.io and returns its stdout.
func ctr(t *testing.T, address string, args ...string) string {
	t.Helper()
	cmd := exec.Command("ctr", append([]string{"--address", address, "--namespace", "k8s.io"}, args...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("ctr %s: %v: %s", strings.Join(args, " "), err, bytes.TrimSpace(stderr.Bytes()))
	}
	return string(out)
}

// startContainerd starts a containerd without the CRI plugin, with all its state in a new
// directory under /tmp (unix socket paths must stay under 108 bytes), and returns its
// socket. Cleanup stops it (SIGTERM, SIGKILL after 10s), unmounts what it left mounted under
// that directory and removes it.
func startContainerd(t *testing.T) string {
	dir, err := os.MkdirTemp("/tmp", "img")
	if err != nil {
		t.Fatal(err)
	}
	address := filepath.Join(dir, "containerd.sock")
	created := hostpaths.Absent()
	config := fmt.Sprintf(`version = 2
root = %q
state = %q
disabled_plugins = ["io.containerd.grpc.v1.cri"]

[grpc]
  address = %q
`, filepath.Join(dir, "root"), filepath.Join(dir, "state"), address)
	configPath := filepath.Join(dir, "config.toml")
	if err := os.WriteFile(configPath, []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	logFile, err := os.Create(filepath.Join(dir, "containerd.log"))
	if err != nil {
		t.Fatal(err)
	}

	cmd := exec.Command("containerd", "--config", configPath)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	p, err := child.Start("containerd", cmd)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = p.Stop(10 * time.Second) // SIGTERM; killed after 10 s
		logFile.Close()
		if t.Failed() {
			if log, err := os.ReadFile(logFile.Name()); err == nil {
				t.Logf("containerd (%v):\n%s", p.Err(), log)
			}
		}
		if err := hostpaths.UnmountBelow(dir); err != nil {
			t.Error(err)
		}
		// containerd and runc also create directories at fixed paths (/run/containerd/…,
		// a k8s.io cgroup per hierarchy): those that were not there before go again.
		if err := hostpaths.RemoveEmptyDirs(created); err != nil {
			t.Error(err)
		}
		if err := os.RemoveAll(dir); err != nil {
			t.Error(err)
		}
	})

	ready := wait.Until(20*time.Second, 20*time.Millisecond, func() bool {
		return p.Exited() || exec.Command("ctr", "--address", address, "version").Run() == nil
	})
	if p.Exited() {
		t.Fatalf("containerd exited: %v", p.Err())
	}
	if !ready {
		t.Fatal("containerd does not answer after 20s")
	}
	return address
}
