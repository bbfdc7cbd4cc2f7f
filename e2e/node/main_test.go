package node_test

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
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
	multiregBin = flag.String("multireg", "", "the multireg binary users get (hack/build-binary.sh): run on the host and put in the image")
	releaseBin  = flag.String("release-multireg", "", "the multireg binary of a release without hand-overs (build-release.sh): the upgrade scenario starts from its image")
	examplesDir = flag.String("examples", "../../examples", "the shipped examples/ directory (DaemonSet and kustomization)")
	workDir     = flag.String("dir", "", "the cluster's directory: short, empty (default: a new one in /tmp)")
)

// The multireg images' references, as containerd's CRI plugin knows them after `ctr images
// import` (the pause image's is images.PauseRef): the binary under test, and the release
// without hand-overs that the upgrade scenario starts from.
const (
	multiregRef = "docker.io/multireg/multireg:e2e"
	releaseRef  = "docker.io/multireg/multireg:e2e-release"
)

// The cluster every scenario runs on, brought up once by TestMain.
var cl *cluster.Cluster

func TestMain(m *testing.M) {
	flag.Parse()
	os.Exit(runMain(m))
}

func runMain(m *testing.M) (code int) {
	if *kubeBin == "" || *thirdparty == "" || *multiregBin == "" || *releaseBin == "" {
		fmt.Fprintln(os.Stderr, "e2e-node: -kube-bin, -thirdparty-bin, -multireg and -release-multireg are required; run it with `make e2e-node` from the repository root")
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
	var tarballs []string
	if err := timed("images (pause, multireg, release)", func() error {
		var err error
		tarballs, err = buildImages(ctx, filepath.Join(dir, "images"))
		return err
	}); err != nil {
		fmt.Fprintln(os.Stderr, "e2e-node:", err)
		return 1
	}
	var err error
	cl, err = cluster.Start(ctx, cluster.Options{Dir: dir, BinDir: *kubeBin, Images: tarballs, PauseImage: images.PauseRef, Log: os.Stdout})
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
	}
	return code
}

// scenarioPhases are the scenarios' durations, and figures the measurements the scenarios
// report, for the summary.
var (
	scenarioPhases []cluster.Phase
	figures        []string
)

func buildImages(ctx context.Context, dir string) ([]string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	pause, err := images.WritePause(ctx, dir)
	if err != nil {
		return nil, err
	}
	// The binary users get, alone in the image as `make image` puts it (without /LICENSE: the
	// image is assembled here, not yet the released one pulled from a registry); and the
	// release, alike.
	tars := []string{pause}
	for _, im := range []struct{ ref, bin, file string }{{multiregRef, *multiregBin, "multireg.tar"}, {releaseRef, *releaseBin, "release.tar"}} {
		mr := images.Image{Ref: im.ref, Files: []images.File{{Path: "/multireg", Source: im.bin, Mode: 0o755}}, Entrypoint: []string{"/multireg"}, User: "0:0"}
		tar := filepath.Join(dir, im.file)
		if err := mr.WriteTarball(tar); err != nil {
			return nil, err
		}
		tars = append(tars, tar)
	}
	return tars, nil
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
