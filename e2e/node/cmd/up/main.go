// Command up brings the single-node test cluster up and keeps it running until interrupted,
// for poking at it by hand (kubectl --kubeconfig DIR/admin.kubeconfig …). It then tears it
// down as the test does. Like the test, it serves the cluster's images from a registry in
// this process, which containerd pulls from: the pause image, which it builds, and each
// -image, an OCI image layout as `make image` writes it (bin/image), pushed as
// REGISTRY/multireg:VERSION; it prints their references.
//
//	go run ./cmd/up -kube-bin BINDIR -dir DIR [-image LAYOUT]...
package main

import (
	"context"
	"errors"
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
	var layouts list
	bin := flag.String("kube-bin", "", "directory of the Kubernetes binaries (build-kube.sh)")
	dir := flag.String("dir", "", "the cluster's directory (short, empty)")
	flag.Var(&layouts, "image", "an OCI image layout to push, as make image writes it (repeatable)")
	flag.Parse()
	if *bin == "" || *dir == "" {
		flag.Usage()
		os.Exit(2)
	}
	if err := run(*bin, *dir, layouts); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

func run(bin, dir string, layouts []string) (err error) {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	imgDir := filepath.Join(dir, "images")
	if err := os.MkdirAll(imgDir, 0o755); err != nil {
		return err
	}
	reg, err := images.StartRegistry(nil)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, reg.Close()) }()
	pause, err := images.PushPause(ctx, imgDir, reg.Host)
	if err != nil {
		return err
	}
	for _, l := range layouts {
		p, err := images.PushLayout(ctx, l, reg.Host+"/multireg")
		if err != nil {
			return err
		}
		fmt.Printf("pushed %s: %s, %s\n", l, p.Tag(), p.ByDigest())
	}
	c, err := cluster.Start(ctx, cluster.Options{Dir: dir, BinDir: bin, Registry: reg.Host, PauseImage: pause, Log: os.Stdout})
	if err != nil {
		return err
	}
	fmt.Printf("cluster up: kubectl --kubeconfig %s get nodes; Ctrl-C tears it down\n", c.Kubeconfig)
	<-ctx.Done()
	if err := c.Stop(); err != nil {
		return fmt.Errorf("teardown: %w", err)
	}
	return nil
}
