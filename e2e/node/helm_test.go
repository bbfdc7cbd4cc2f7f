package node_test

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/cli"
	"helm.sh/helm/v3/pkg/cli/values"
	"helm.sh/helm/v3/pkg/getter"

	"multireg.dev/multireg/e2e/internal/doccmd"
	"multireg.dev/multireg/e2e/internal/fileid"
	"multireg.dev/multireg/e2e/node/endpoints"
)

// The README's install, run on the node, is not part of the scenarios' run (it builds and
// pushes the image again, minutes on a cold cache): -helm runs it, on a cluster of its own,
// with
//
//	sudo make e2e-node-helm        # from the repository's root; part of make test-nightly
//
// or `sudo make e2e-node KUBE=1.37 NODE_ARGS='-test.run=TestHelmInstall -helm'` (see README.md
// here). Either way make runs this test, and the test runs the README's make commands as a
// user's shell would (doccmd).
var helmScenario = flag.Bool("helm", false, "run TestHelmInstall: the README's install with Helm, then upgrade, rollback and uninstall")

// TestHelmInstall's drivers: two CSI drivers (the upgrade moves the second to a new endpoint
// answering another node ID) and a device plugin.
const (
	helmCSIA     = "alpha.helm.multireg.test"
	helmCSIB     = "beta.helm.multireg.test"
	helmGadget   = "example.com/helm-gadget"
	nHelmGadgets = 2
	helmNS       = "kube-system"
	// readmeImage is the image the README's install pushes and names; the scenario pushes to
	// the test's registry instead.
	readmeImage = "registry.example.com/you/multireg"
)

var helmDrivers = []string{helmCSIA, helmCSIB, helmGadget}

// repoRoot is the repository's root: this package is e2e/node.
func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// readmeInstall returns the shell lines of the README's "Install" section, in order, each
// continued line joined and comments dropped: `make image-push`, `helm install`, then the
// verification's `kubectl` lines.
func readmeInstall(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot(t), "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	s := string(b)
	start := strings.Index(s, "\n## Install\n")
	if start < 0 {
		t.Fatal("README.md has no Install section")
	}
	s = s[start+1:]
	if end := strings.Index(s[1:], "\n## "); end >= 0 {
		s = s[:end+1]
	}
	var lines []string
	for _, m := range regexp.MustCompile("(?ms)^```sh\n(.*?)^```").FindAllStringSubmatch(s, -1) {
		block := regexp.MustCompile(`\\\n\s*`).ReplaceAllString(m[1], "")
		for _, l := range strings.Split(block, "\n") {
			l = strings.TrimSpace(regexp.MustCompile(`\s+#.*$`).ReplaceAllString(l, ""))
			if l != "" && !strings.HasPrefix(l, "#") {
				lines = append(lines, l)
			}
		}
	}
	return lines
}

// helmEnv is where the scenario's commands run: the test's registry instead of the README's,
// the test's values file instead of my-drivers.yaml.
type helmEnv struct {
	repo   string // REGISTRY/you/multireg in the test's registry
	values string // the values file, the node's drivers
	csi    map[string]*endpoints.CSI
	dp     *endpoints.DevicePlugin
	pushed string // what make image-push printed it pushed: REPO:TAG@DIGEST
}

// command runs one documented command line, the README's registry and values file replaced
// by the test's: make in the repository's root, helm through Helm's Go library (helmCommand),
// kubectl against the cluster.
func (e *helmEnv) command(t *testing.T, line string) string {
	t.Helper()
	line = strings.ReplaceAll(line, readmeImage, e.repo)
	line = strings.ReplaceAll(line, "my-drivers.yaml", e.values)
	line = strings.ReplaceAll(line, "my-values.yaml", e.values)
	t.Logf("$ %s", line)
	line = substitute(t, line)
	args := strings.Fields(line)
	start := time.Now()
	var out string
	var err error
	switch args[0] {
	case "make":
		// As the user's shell runs it, though make runs this test (doccmd.Make: without the
		// parent makes' variables, --no-print-directory).
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
		defer cancel()
		var b []byte
		b, err = doccmd.Make(ctx, repoRoot(t), args[1:]...).CombinedOutput()
		out = string(b)
	case "helm":
		out, err = helmCommand(t, args[1:])
	case "kubectl":
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		out, err = cl.Kubectl(ctx, args[1:]...)
	default:
		t.Fatalf("%q: not a make, helm or kubectl command", line)
	}
	if err != nil {
		t.Fatalf("%s: %v\n%s", line, err, out)
	}
	t.Logf("  (%.1fs)\n%s", time.Since(start).Seconds(), out)
	return out
}

// substitute replaces each command substitution $(...) of line with what the command prints,
// run by sh in the repository's root, as the user's shell would (doccmd.Shell: without the
// parent makes' variables).
func substitute(t *testing.T, line string) string {
	t.Helper()
	return regexp.MustCompile(`\$\(([^()]*)\)`).ReplaceAllStringFunc(line, func(m string) string {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		out, err := doccmd.Shell(ctx, repoRoot(t), m[2:len(m)-1]).Output()
		if err != nil {
			t.Fatalf("%s: %v", m, err)
		}
		t.Logf("  %s = %s", m, strings.TrimSpace(string(out)))
		return strings.TrimSpace(string(out))
	})
}

// helmCommand is the helm command line args (after "helm") run with Helm's Go library:
// install, upgrade, rollback, test and uninstall, with the flags the docs use. A flag or a
// command it does not know fails, so that a change of the docs shows here.
func helmCommand(t *testing.T, args []string) (string, error) {
	t.Helper()
	ns := "default"
	var files, sets, pos []string
	var reuse, wait, logs bool
	cascade := "background"
	for i := 0; i < len(args); i++ {
		a := args[i]
		if !strings.HasPrefix(a, "-") {
			pos = append(pos, a)
			continue
		}
		name, val, hasVal := strings.Cut(a, "=")
		next := func() string {
			if hasVal {
				return val
			}
			if i++; i >= len(args) {
				t.Fatalf("helm %s: %s without its value", strings.Join(args, " "), name)
			}
			return args[i]
		}
		switch name {
		case "-n", "--namespace":
			ns = next()
		case "-f", "--values":
			files = append(files, next())
		case "--set":
			sets = append(sets, next())
		case "--cascade":
			cascade = next()
		case "--reuse-values":
			reuse = true
		case "--wait":
			wait = true
		case "--logs":
			logs = true
		default:
			return "", fmt.Errorf("flag %s: the test's helm does not know it", name)
		}
	}
	if len(pos) < 2 {
		return "", fmt.Errorf("want a command and a release: %q", args)
	}
	settings := cli.New()
	settings.KubeConfig = cl.Kubeconfig
	settings.SetNamespace(ns)
	cfg := new(action.Configuration)
	if err := cfg.Init(settings.RESTClientGetter(), ns, "secret", func(format string, v ...any) { t.Logf("helm: "+format, v...) }); err != nil {
		return "", err
	}
	chartAndValues := func() (map[string]any, error) {
		if len(pos) < 3 {
			return nil, fmt.Errorf("%s: no chart", pos[0])
		}
		return (&values.Options{ValueFiles: files, Values: sets}).MergeValues(getter.All(settings))
	}
	const timeout = 5 * time.Minute
	cmd, name := pos[0], pos[1]
	switch cmd {
	case "install", "upgrade":
		vals, err := chartAndValues()
		if err != nil {
			return "", err
		}
		ch, err := loader.Load(filepath.Join(repoRoot(t), pos[2]))
		if err != nil {
			return "", err
		}
		if cmd == "install" {
			inst := action.NewInstall(cfg)
			inst.ReleaseName, inst.Namespace, inst.Wait, inst.Timeout = name, ns, wait, timeout
			rel, err := inst.Run(ch, vals)
			if err != nil {
				return "", err
			}
			return fmt.Sprintf("release %s revision %d %s\n%s", rel.Name, rel.Version, rel.Info.Status, rel.Info.Notes), nil
		}
		up := action.NewUpgrade(cfg)
		up.Namespace, up.ReuseValues, up.Wait, up.Timeout = ns, reuse, wait, timeout
		rel, err := up.Run(name, ch, vals)
		if err != nil {
			return "", err
		}
		return fmt.Sprintf("release %s revision %d %s", rel.Name, rel.Version, rel.Info.Status), nil
	case "rollback":
		rb := action.NewRollback(cfg)
		rb.Wait, rb.Timeout = wait, timeout
		if len(pos) > 2 {
			v, err := strconv.Atoi(pos[2])
			if err != nil {
				return "", fmt.Errorf("rollback: revision %q: %v", pos[2], err)
			}
			rb.Version = v
		}
		return "rolled back " + name, rb.Run(name)
	case "test":
		rt := action.NewReleaseTesting(cfg)
		rt.Namespace, rt.Timeout = ns, timeout
		rel, err := rt.Run(name)
		var out bytes.Buffer
		if logs && rel != nil {
			if lerr := rt.GetPodLogs(&out, rel); lerr != nil && err == nil {
				err = lerr
			}
		}
		return out.String(), err
	case "uninstall":
		un := action.NewUninstall(cfg)
		un.Wait, un.DeletionPropagation, un.Timeout = wait, cascade, timeout
		res, err := un.Run(name)
		if err != nil {
			return "", err
		}
		return "uninstalled " + res.Release.Name, nil
	}
	return "", fmt.Errorf("helm %s: the test's helm does not know it", cmd)
}

// writeValues writes the values file: the node's kubelet root and drivers, beta at the
// endpoint betaDir/csi.sock.
func (e *helmEnv) writeValues(t *testing.T, betaDir string) {
	t.Helper()
	v := fmt.Sprintf(`kubeletDir: %s
drivers:
  - name: %s
    type: CSIPlugin
    endpoint: %s
  - name: %s
    type: CSIPlugin
    endpoint: %s
  - name: %s
    type: DevicePlugin
    endpoint: %s
`, cl.KubeletRoot, helmCSIA, endpointPath("helm-alpha", "csi.sock"), helmCSIB, endpointPath(betaDir, "csi.sock"),
		helmGadget, endpointPath("helm-gadget", "dp.sock"))
	writeFileAtomic(t, e.values, v)
}

// TestHelmInstall runs the README's install verbatim on the node, its registry and values
// file aside: `make image-push` to the test's registry, `helm install` of charts/multireg with
// a values file listing the node's drivers, `kubectl rollout status`, `kubectl exec ds/multireg
// -- /multireg status`; then `helm test`, a `helm upgrade` that moves one driver to a new
// endpoint (only that driver moves: the other's CSINode entry, NodeGetInfo count, attempts and
// socket, the gadgets' allocatable and the pod stay; its own gap in CSINode logged in ms),
// `helm rollback` (the same, back), and the uninstall of docs/deploy.md (cleanupOnExit, then
// `helm uninstall --cascade=foreground --wait`): every registration socket gone, kubelet
// deregisters every driver, and nothing else in kubelet's directories is touched.
func TestHelmInstall(t *testing.T) {
	if !*helmScenario {
		t.Skip("the README's install with Helm runs with -helm only")
	}
	if cl.PluginsDir != filepath.Join(cl.KubeletRoot, "plugins") || cl.PluginsRegistry != filepath.Join(cl.KubeletRoot, "plugins_registry") {
		t.Fatalf("the node's plugins directories %s and %s are not where the chart's kubeletDir puts them, below %s", cl.PluginsDir, cl.PluginsRegistry, cl.KubeletRoot)
	}
	e := &helmEnv{repo: reg.Host + "/you/multireg", values: filepath.Join(tempDir(t), "my-drivers.yaml"), csi: map[string]*endpoints.CSI{}}
	for _, c := range []struct{ dir, name, nodeID string }{
		{"helm-alpha", helmCSIA, "alpha-node-1"}, {"helm-beta", helmCSIB, "beta-node-1"}, {"helm-beta-v2", helmCSIB, "beta-node-2"},
	} {
		ep, err := endpoints.StartCSI(endpointPath(c.dir, "csi.sock"), endpoints.CSIOptions{Name: c.name, NodeID: c.nodeID})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(ep.Stop)
		e.csi[c.dir] = ep
	}
	var err error
	if e.dp, err = endpoints.StartDevicePlugin(endpointPath("helm-gadget", "dp.sock"), endpoints.DeviceOptions{ResourceName: helmGadget, Devices: nHelmGadgets}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.dp.Stop)
	// What the uninstall must leave: a file of another registrar in kubelet's registry
	// directory, and the drivers' own sockets.
	sentinel := filepath.Join(cl.PluginsRegistry, "other-registrar.conf")
	if err := os.WriteFile(sentinel, []byte("not multireg's\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(sentinel) })
	untouched := map[string]fileid.ID{sentinel: fileid.Of(sentinel)}
	for dir, ep := range e.csi {
		untouched[dir] = fileid.Of(ep.Path())
	}
	untouched["helm-gadget"] = fileid.Of(endpointPath("helm-gadget", "dp.sock"))
	e.writeValues(t, "helm-beta")

	lines := readmeInstall(t)
	var install string
	for _, l := range lines {
		if strings.HasPrefix(l, "helm install ") {
			install = l
		}
	}
	if len(lines) < 4 || !strings.HasPrefix(lines[0], "make image-push ") || install == "" {
		t.Fatalf("the README's install is not make image-push, helm install, then the verification: %q", lines)
	}
	t.Cleanup(func() {
		// Whatever failed, leave no release behind for the scenarios after this one.
		if _, err := helmCommand(t, []string{"-n", helmNS, "uninstall", "multireg", "--cascade=foreground", "--wait"}); err != nil {
			t.Logf("cleanup: helm uninstall: %v", err)
		}
		waitNoPods(t)
	})

	_ = scenario(t, "helm-1-readme-install", func(t *testing.T) {
		start := time.Now()
		for _, l := range lines {
			out := e.command(t, l)
			switch {
			case strings.HasPrefix(l, "make image-push"):
				var err error
				if e.pushed, err = doccmd.PushedImage(out, e.repo); err != nil {
					t.Fatal(err)
				}
			case strings.Contains(l, "/multireg status"):
				if !strings.Contains(out, fmt.Sprintf("%d of %d drivers registered", len(helmDrivers), len(helmDrivers))) {
					t.Errorf("multireg status in the pod:\n%s\nwant every driver registered", out)
				}
			}
		}
		pod := waitPodReady(t, 3*time.Minute, "")
		t.Logf("the README's install: %.1fs from make image-push to multireg status", time.Since(start).Seconds())
		// The pod runs what make image-push pushed, by the tag the README's install sets
		// (make -s image-tag: the chart's appVersion names a release, not this tree).
		tag, digest, _ := strings.Cut(strings.TrimPrefix(e.pushed, e.repo+":"), "@")
		if want := substitute(t, "$(make -s image-tag)"); tag != want {
			t.Errorf("make image-push pushed the tag %s; make -s image-tag, which the install sets, says %s", tag, want)
		}
		if cs := pod.Status.ContainerStatuses; len(cs) != 1 || !strings.HasSuffix(cs[0].ImageID, "@"+digest) || cs[0].Image != e.repo+":"+tag {
			t.Errorf("the pod's container: %+v; want the image %s:%s, its imageID …@%s", cs, e.repo, tag, digest)
		}
		waitCSINode(t, map[string]string{helmCSIA: "alpha-node-1", helmCSIB: "beta-node-1"}, 60*time.Second)
		waitRegisteredAt(t, "multireg in pod "+pod.Name, podStatusURL(pod), helmDrivers...)
		waitKubeletHolds(t, helmDrivers...)
		waitGadgets(t, nHelmGadgets)
	}) &&
		scenario(t, "helm-2-test", func(t *testing.T) {
			out := e.command(t, "helm test multireg -n kube-system --logs")
			if !strings.Contains(out, fmt.Sprintf("valid: %d drivers", len(helmDrivers))) {
				t.Errorf("helm test --logs:\n%s\nwant multireg validate's verdict on the %d drivers", out, len(helmDrivers))
			}
		}) &&
		scenario(t, "helm-3-upgrade-moves-one-driver", func(t *testing.T) {
			e.writeValues(t, "helm-beta-v2")
			e.onlyBetaMoves(t, strings.Replace(install, "helm install ", "helm upgrade ", 1), "beta-node-2")
		}) &&
		scenario(t, "helm-4-rollback", func(t *testing.T) {
			e.onlyBetaMoves(t, "helm rollback multireg -n kube-system", "beta-node-1")
		}) &&
		scenario(t, "helm-5-uninstall", func(t *testing.T) {
			socks := map[string]string{}
			for _, n := range helmDrivers {
				socks[n] = socketOf(t, n)
			}
			// docs/deploy.md, "Uninstall", with Helm (--reuse-values: the install's values).
			for _, l := range []string{
				"helm -n kube-system upgrade multireg charts/multireg --reuse-values --set cleanupOnExit=true",
				"kubectl -n kube-system rollout status ds/multireg",
				"kubectl -n kube-system delete ds multireg --cascade=foreground --wait",
				"helm -n kube-system uninstall multireg --cascade=foreground --wait",
			} {
				e.command(t, l)
			}
			if pods, err := multiregPods(context.Background()); err != nil || len(pods) != 0 {
				t.Errorf("multireg pods after helm uninstall --wait: %d, %v; want none", len(pods), err)
			}
			for n, s := range socks {
				if _, err := os.Lstat(s); !os.IsNotExist(err) {
					t.Errorf("%s's registration socket %s is still there (%v)", n, s, err)
				}
			}
			entries, err := os.ReadDir(cl.PluginsRegistry)
			if err != nil {
				t.Fatal(err)
			}
			for _, en := range entries {
				if en.Type()&os.ModeSocket != 0 {
					t.Errorf("a socket is left in kubelet's registry directory: %s", en.Name())
				}
			}
			waitUntil(t, 30*time.Second, "kubelet deregisters every driver", func(ctx context.Context) (bool, string) {
				drivers, err := csiNodeDrivers(ctx)
				if err != nil {
					return false, err.Error()
				}
				_, a, err := capacity(ctx, helmGadget)
				if err != nil {
					return false, err.Error()
				}
				_, inA := drivers[helmCSIA]
				_, inB := drivers[helmCSIB]
				return !inA && !inB && a == 0, fmt.Sprintf("CSINode %v, %s allocatable %d", drivers, helmGadget, a)
			})
			for what, id := range untouched {
				path := what
				if !filepath.IsAbs(path) {
					path = endpointPath(what, "csi.sock")
					if what == "helm-gadget" {
						path = endpointPath(what, "dp.sock")
					}
				}
				if now := fileid.Of(path); now != id {
					t.Errorf("the uninstall touched %s (%+v → %+v)", path, id, now)
				}
			}
		})
}

// onlyBetaMoves runs line (a helm upgrade or rollback that changes beta's endpoint, so that
// CSINode shows beta's node ID wantBeta) and checks that only beta moved: alpha never left
// CSINode and was not registered again (NodeGetInfo, attempts, socket), the gadgets stayed
// allocatable, and the pod is the same. Beta's absence from CSINode is logged in ms.
func (e *helmEnv) onlyBetaMoves(t *testing.T, line, wantBeta string) {
	t.Helper()
	pod := waitPodReady(t, 30*time.Second, "")
	before := waitRegisteredAt(t, "multireg in pod "+pod.Name, podStatusURL(pod), helmDrivers...)
	socks := idents(t, helmCSIA, helmGadget)
	alphaCalls, _ := e.csi["helm-alpha"].NodeGetInfoCalls()
	w := watchCSINode(t)
	gadgets := watchAllocatable(t, helmGadget, nHelmGadgets)
	start := time.Now()
	e.command(t, line)
	waitCSINode(t, map[string]string{helmCSIA: "alpha-node-1", helmCSIB: wantBeta}, 90*time.Second)
	d := time.Since(start) // the command's own time included: kubelet updates the ConfigMap's volume after it
	stays(t, 2500*time.Millisecond, "only "+helmCSIB+" moves", func(ctx context.Context) (string, error) {
		if n, _ := e.csi["helm-alpha"].NodeGetInfoCalls(); n != alphaCalls {
			return fmt.Sprintf("%s registered again (NodeGetInfo %d → %d)", helmCSIA, alphaCalls, n), nil
		}
		st, err := statusAt(ctx, podStatusURL(pod))
		if err != nil {
			return "", err
		}
		for _, n := range []string{helmCSIA, helmGadget} {
			if st[n].Phase != "Registered" || st[n].Attempts != before[n].Attempts {
				return fmt.Sprintf("%s: %+v, before %+v", n, st[n], before[n]), nil
			}
		}
		return "", nil
	})
	gaps := w.catchUp(t)
	live, status, looks := gadgets.stop()
	var betaGaps []string
	for _, g := range gaps[helmCSIB] {
		betaGaps = append(betaGaps, fmt.Sprintf("%dms", g.Milliseconds()))
	}
	t.Logf("%s: CSINode shows %s's node ID %s %dms after the command; %s missing from CSINode %d time(s) %v; %s missing %d time(s); %s short of allocatable %dms (pod resources) / %dms (node status) over %d looks",
		line, helmCSIB, wantBeta, d.Milliseconds(), helmCSIB, len(gaps[helmCSIB]), betaGaps, helmCSIA, len(gaps[helmCSIA]), helmGadget, live.Milliseconds(), status.Milliseconds(), looks)
	figures = append(figures, fmt.Sprintf("%s: %s moved in %dms, missing from CSINode %v; %s missing %d time(s); %s short %dms",
		strings.Fields(line)[1], helmCSIB, d.Milliseconds(), betaGaps, helmCSIA, len(gaps[helmCSIA]), helmGadget, status.Milliseconds()))
	if len(gaps[helmCSIA]) != 0 {
		t.Errorf("%s left CSINode during %q: %v", helmCSIA, line, gaps[helmCSIA])
	}
	if live != 0 || status != 0 {
		t.Errorf("%s was short of allocatable during %q: %s (pod resources), %s (node status)", helmGadget, line, live, status)
	}
	assertSame(t, "the sockets of the drivers that did not change", socks, idents(t, helmCSIA, helmGadget))
	if now := waitPodReady(t, 30*time.Second, ""); now.UID != pod.UID || restarts(now) != 0 {
		t.Errorf("%q replaced or restarted the pod: %s (uid %s, %d restarts), before %s (uid %s)", line, now.Name, now.UID, restarts(now), pod.Name, pod.UID)
	}
	waitRegisteredAt(t, "multireg in pod "+pod.Name, podStatusURL(pod), helmDrivers...)
}

// waitGadgets waits until the node shows n helm gadgets, capacity and allocatable.
func waitGadgets(t *testing.T, n int64) {
	t.Helper()
	waitUntil(t, 60*time.Second, "node capacity "+helmGadget, func(ctx context.Context) (bool, string) {
		c, a, err := capacity(ctx, helmGadget)
		if err != nil {
			return false, err.Error()
		}
		return c == n && a == n, fmt.Sprintf("capacity %d, allocatable %d", c, a)
	})
}
