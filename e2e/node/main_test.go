package node_test

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"text/tabwriter"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/node/cluster"
	"multireg.dev/multireg/e2e/node/hostpaths"
	"multireg.dev/multireg/e2e/node/images"
)

var (
	kubeBin     = flag.String("kube-bin", "", "directory of the Kubernetes binaries (build-kube.sh)")
	thirdparty  = flag.String("thirdparty-bin", "", "directory of the third-party plugins (build-thirdparty.sh)")
	multiregBin = flag.String("multireg", "", "the multireg binary users get (hack/build-binary.sh): run on the host")
	imageLayout = flag.String("image", "", "multireg's image as `make image` builds it (the OCI image layout bin/image): pushed to the test's registry, and run by the DaemonSet")
	releaseBin  = flag.String("release-multireg", "", "the multireg binary of a release without hand-overs (build-release.sh): its version")
	releaseImg  = flag.String("release-image", "", "that release's image, built by hack/image from that binary (build-release.sh): the upgrade scenario starts from it")
	examplesDir = flag.String("examples", "../../examples", "the shipped examples/ directory (DaemonSet and kustomization)")
	workDir     = flag.String("dir", "", "the cluster's directory: short, empty (default: a new one in /tmp)")
)

// The images, pushed by TestMain to reg, the registry in this process that the cluster's
// containerd pulls from: multireg's image as `make image` built it (every platform) and the
// release's, both in REGISTRY/multireg under their versions' tags, and the sandbox image.
var (
	reg          *images.Registry
	underTest    images.Pushed
	releaseImage images.Pushed
	pauseRef     string
)

// The cluster every scenario runs on, brought up once by TestMain.
var cl *cluster.Cluster

func TestMain(m *testing.M) {
	flag.Parse()
	os.Exit(runMain(m))
}

func runMain(m *testing.M) (code int) {
	if *kubeBin == "" || *thirdparty == "" || *multiregBin == "" || *imageLayout == "" || *releaseBin == "" || *releaseImg == "" {
		fmt.Fprintln(os.Stderr, "e2e-node: -kube-bin, -thirdparty-bin, -multireg, -image, -release-multireg and -release-image are required; run it with `make e2e-node` from the repository root")
		return 2
	}
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "e2e-node: FAIL: needs root: the single-node cluster mounts, sets sysctls, runs containerd and creates a network bridge (CI runs it as root)")
		return 1
	}
	dir := *workDir
	if dir == "" {
		d, err := os.MkdirTemp("/tmp", "mrn.")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		dir = d
		// Removed after the teardown (deferred first, so run last), unless something is
		// still mounted below it.
		defer func() {
			if err := hostpaths.UnmountBelow(dir); err == nil {
				_ = os.RemoveAll(dir)
			}
		}()
	}
	var phases []cluster.Phase
	timed := func(name string, f func() error) error { return cluster.TimePhase(os.Stdout, &phases, name, f) }
	defer func() { printPhases(phases) }()

	// Ctrl-C or SIGTERM: the components run in their own process groups and would outlive
	// this binary. During the image build and Start, ctx ends and Start tears down what it
	// started; during the scenarios, the teardown below runs, once, and the binary exits.
	ctx, stopSignals := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stopSignals()
	var stopRegistry func() error
	if err := timed("registry + images (pause, multireg, release)", func() error {
		var err error
		stopRegistry, err = startRegistry(ctx, dir)
		return err
	}); err != nil {
		fmt.Fprintln(os.Stderr, "e2e-node:", err)
		return 1
	}
	defer func() {
		if err := stopRegistry(); err != nil {
			fmt.Fprintln(os.Stderr, "e2e-node:", err)
			code = 1
		}
	}()
	fmt.Printf("e2e-node: registry %s: %s (index %s), %s (index %s), %s\n", reg.Host, underTest.Tag(), underTest.Digest, releaseImage.Tag(), releaseImage.Digest, pauseRef)
	var err error
	cl, err = cluster.Start(ctx, cluster.Options{Dir: dir, BinDir: *kubeBin, Registry: reg.Host, PauseImage: pauseRef, Log: os.Stdout})
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e-node: cluster:", err)
		return 1
	}
	phases = append(phases, cl.Phases()...)
	teardown := sync.OnceValue(func() error { return errors.Join(deleteWorkloads(cl), cl.Stop()) })
	testsDone := make(chan struct{})
	watcherDone := make(chan struct{})
	go func() {
		defer close(watcherDone)
		select {
		case <-ctx.Done():
			fmt.Fprintln(os.Stderr, "e2e-node: interrupted: tearing the cluster down")
			if err := teardown(); err != nil {
				fmt.Fprintln(os.Stderr, "e2e-node: teardown:", err)
			}
			os.Exit(1)
		case <-testsDone:
		}
	}()
	defer func() {
		// A signal from here on is caught (ctx) but acted on by nobody: the teardown below
		// is already the one that runs.
		close(testsDone)
		<-watcherDone
		if err := timed("teardown", teardown); err != nil {
			fmt.Fprintln(os.Stderr, "e2e-node: teardown:", err)
			code = 1
		}
	}()
	testsStart := time.Now()
	code = m.Run()
	phases = append(phases, cluster.Phase{Name: "scenarios", Duration: time.Since(testsStart)})
	phases = append(phases, scenarioPhases...)
	fmt.Printf("e2e-node: Kubernetes %s\n", cl.Version)
	for _, f := range figures {
		fmt.Println("e2e-node figure:", f)
	}
	if code != 0 {
		fmt.Println(cl.Logs(40))
		fmt.Printf("----- the registry's last requests -----\n%s\n", cluster.LastLines(requestLog(reg.Requests()), 40))
	}
	return code
}

// scenarioPhases are the scenarios' durations, and figures the measurements the scenarios
// report, for the summary.
var (
	scenarioPhases []cluster.Phase
	figures        []string
)

// startRegistry starts reg, the registry the cluster pulls from (its log in dir/registry.log),
// and pushes the images to it: multireg's layout and the release's, each whole, by their tags,
// and the pause image built here. stop closes the registry and its log; on error, startRegistry
// does.
func startRegistry(ctx context.Context, dir string) (stop func() error, err error) {
	if err := os.MkdirAll(filepath.Join(dir, "images"), 0o755); err != nil {
		return nil, err
	}
	logFile, err := os.Create(filepath.Join(dir, "registry.log"))
	if err != nil {
		return nil, err
	}
	if reg, err = images.StartRegistry(logFile); err != nil {
		logFile.Close()
		return nil, err
	}
	stop = func() error { return errors.Join(reg.Close(), logFile.Close()) }
	defer func() {
		if err != nil {
			err = errors.Join(err, stop())
			stop = nil
		}
	}()
	repo := reg.Host + "/multireg"
	if underTest, err = images.PushLayout(ctx, *imageLayout, repo); err != nil {
		return stop, err
	}
	if releaseImage, err = images.PushLayout(ctx, *releaseImg, repo); err != nil {
		return stop, err
	}
	if releaseImage.Version == underTest.Version {
		return stop, fmt.Errorf("the release's image (%s) and the image under test (%s) have one version, %s: the upgrade needs two tags", *releaseImg, *imageLayout, underTest.Version)
	}
	for _, p := range []images.Pushed{underTest, releaseImage} {
		if _, ok := p.Platforms[hostPlatform()]; !ok {
			return stop, fmt.Errorf("%s: no image for this node's platform %s (platforms: %v)", p.Tag(), hostPlatform(), p.PlatformNames())
		}
	}
	pauseRef, err = images.PushPause(ctx, filepath.Join(dir, "images"), reg.Host)
	return stop, err
}

// hostPlatform is the node's platform, as an image index names it (linux/amd64; linux/arm/v7).
func hostPlatform() string {
	if runtime.GOARCH == "arm" {
		return "linux/arm/v7"
	}
	return "linux/" + runtime.GOARCH
}

// requestLog is requests, one a line.
func requestLog(requests []images.Request) string {
	var b strings.Builder
	for _, r := range requests {
		fmt.Fprintln(&b, r)
	}
	return b.String()
}

// deleteWorkloads removes what the scenarios ran — the DaemonSets of kube-system and every
// pod — and waits (bounded) for the pods to be gone, so that kubelet stops their containers
// and releases their claims before it is stopped.
func deleteWorkloads(c *cluster.Cluster) error {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	dss := c.Client.AppsV1().DaemonSets("kube-system")
	list, err := dss.List(ctx, metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("list DaemonSets: %w", err)
	}
	for _, ds := range list.Items {
		if err := dss.Delete(ctx, ds.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete DaemonSet %s: %w", ds.Name, err)
		}
	}
	pods := c.Client.CoreV1().Pods(metav1.NamespaceAll)
	return wait.Poll(ctx, 250*time.Millisecond, "every pod gone within 90s (the teardown removes their containers)", func() (bool, error) {
		list, err := pods.List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		for _, p := range list.Items {
			if p.DeletionTimestamp == nil {
				_ = c.Client.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{})
			}
		}
		return len(list.Items) == 0, fmt.Errorf("%d pods still there", len(list.Items))
	})
}

func printPhases(phases []cluster.Phase) {
	if len(phases) == 0 {
		return
	}
	var b strings.Builder
	w := tabwriter.NewWriter(&b, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "phase\tseconds\t")
	for _, p := range phases {
		fmt.Fprintf(w, "%s\t%.1f\t\n", p.Name, p.Duration.Seconds())
	}
	w.Flush()
	fmt.Printf("\ne2e-node phases:\n%s", b.String())
}

// scenario runs one scenario as a subtest and records its duration for the phase summary.
func scenario(t *testing.T, name string, f func(t *testing.T)) bool {
	start := time.Now()
	ok := t.Run(name, f)
	scenarioPhases = append(scenarioPhases, cluster.Phase{Name: "  " + name, Duration: time.Since(start)})
	return ok
}
