// Command up brings the single-node test cluster up and keeps it running until interrupted,
// for poking at it by hand (kubectl --kubeconfig DIR/admin.kubeconfig …). It then tears it
// down as the test does. It builds and imports the pause image itself; -image imports more.
//
//	go run ./cmd/up -kube-bin BINDIR -dir DIR [-image TARBALL]...
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"

	"multireg.dev/multireg/e2e/node/cluster"
	"multireg.dev/multireg/e2e/node/images"
)

type list []string

func (l *list) String() string     { return strings.Join(*l, ",") }
func (l *list) Set(v string) error { *l = append(*l, v); return nil }

func main() {
	var extra list
	bin := flag.String("kube-bin", "", "directory of the Kubernetes binaries (build-kube.sh)")
	dir := flag.String("dir", "", "the cluster's directory (short, empty)")
	flag.Var(&extra, "image", "image tarball to import (repeatable)")
	flag.Parse()
	if *bin == "" || *dir == "" {
		flag.Usage()
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	imgDir := filepath.Join(*dir, "images")
	if err := os.MkdirAll(imgDir, 0o755); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	pause, err := images.WritePause(ctx, imgDir)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	c, err := cluster.Start(ctx, cluster.Options{Dir: *dir, BinDir: *bin, Images: append([]string{pause}, extra...), PauseImage: images.PauseRef, Log: os.Stdout})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Printf("cluster up: kubectl --kubeconfig %s get nodes; Ctrl-C tears it down\n", c.Kubeconfig)
	<-ctx.Done()
	if err := c.Stop(); err != nil {
		fmt.Fprintln(os.Stderr, "teardown:", err)
		os.Exit(1)
	}
}
