package images

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"multireg.dev/multireg/e2e/internal/child"
	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/node/hostpaths"
)

// TestContainerdPulls has a private containerd pull a pause image from a Registry through the
// registry configuration WriteHostsDir writes, as the e2e cluster's containerd does, by tag
// and by digest, and checks that containerd stores it under that reference, unpacked, that
// the image came over plain HTTP from the registry, and that it runs.
func TestContainerdPulls(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: containerd mounts overlayfs to unpack images")
	}
	for _, bin := range []string{"containerd", "ctr"} {
		if _, err := exec.LookPath(bin); err != nil {
			t.Skipf("needs %s: %v", bin, err)
		}
	}
	address := startContainerd(t)
	reg := startRegistry(t)
	dir := t.TempDir()
	hostsDir := filepath.Join(dir, "certs.d")
	if err := WriteHostsDir(hostsDir, reg.Host); err != nil {
		t.Fatal(err)
	}
	ref, err := PushPause(t.Context(), dir, reg.Host)
	if err != nil {
		t.Fatal(err)
	}
	if ref != reg.Host+"/"+PauseName {
		t.Errorf("PushPause pushed %s; want %s/%s", ref, reg.Host, PauseName)
	}
	img := pull(t, ref)
	digest, err := img.Digest()
	if err != nil {
		t.Fatal(err)
	}
	byDigest := reg.Host + "/pause@" + digest.String()
	before := len(reg.Requests())
	for _, r := range []string{ref, byDigest} {
		start := time.Now()
		ctr(t, address, "images", "pull", "--hosts-dir", hostsDir, r)
		t.Logf("ctr images pull %s: %v", r, time.Since(start))
	}
	var asked []string
	for _, r := range reg.Requests()[before:] {
		asked = append(asked, r.String())
	}
	for _, want := range []string{"/v2/pause/manifests/e2e 200", "/v2/pause/manifests/" + digest.String() + " 200"} {
		if !slices.ContainsFunc(asked, func(a string) bool { return strings.HasSuffix(a, want) }) {
			t.Errorf("containerd's pulls asked the registry %q; want a request for %s", asked, want)
		}
	}

	refs := strings.Fields(ctr(t, address, "images", "ls", "-q"))
	slices.Sort(refs)
	if want := []string{ref, byDigest}; !slices.Equal(refs, want) { // ':' sorts before '@'
		t.Errorf("images in k8s.io: %q, want %q", refs, want)
	}
	// Unpacked: the layer's snapshot is named by its chain ID, the diff ID for one layer.
	cfg, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	snapshots := ctr(t, address, "snapshots", "ls")
	if chainID := cfg.RootFS.DiffIDs[0].String(); !strings.Contains(snapshots, chainID) {
		t.Errorf("snapshots:\n%s\nwant %s (the unpacked layer)", snapshots, chainID)
	}

	// containerd 1.6 would speak plain HTTP to a registry on the loopback without being told;
	// that it reads the file WriteHostsDir wrote for this host shows when the file names
	// another server: nothing listens there, and the pull fails. (containerd 1.6.20 follows
	// the [host] entry: a file naming the dead server as `server` alone was not followed.)
	closed, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed.Close()
	toml := fmt.Sprintf("server = %[1]q\n[host.%[1]q]\n  capabilities = [\"pull\", \"resolve\"]\n", "http://"+closed.Addr().String())
	if err := os.WriteFile(filepath.Join(hostsDir, reg.Host, "hosts.toml"), []byte(toml), 0o644); err != nil {
		t.Fatal(err)
	}
	pull := exec.Command("ctr", "--address", address, "--namespace", "k8s.io", "images", "pull", "--hosts-dir", hostsDir, reg.Host+"/pause:other")
	if out, err := pull.CombinedOutput(); err == nil || !strings.Contains(string(out), closed.Addr().String()) {
		t.Errorf("ctr images pull with hosts.toml naming %s: %v; want an error naming that address:\n%s", closed.Addr(), err, out)
	}

	t.Run("run", func(t *testing.T) { runPause(t, address, ref) })
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
