// Command image builds multireg's multi-platform image as an OCI image layout, without a
// container daemon, and pushes it to a registry. The Makefile's image and image-push targets
// run it; see CONTRIBUTING.md.
//
//	image build -binaries DIR -license FILE -version V [-tag T] -commit C -out LAYOUT
//	    (SOURCE_DATE_EPOCH: the creation time, the commit's time; the layout's entry is named
//	    by the tag, default V with + made a dot: a tag may not hold a +)
//	image push  -layout LAYOUT -image REGISTRY/NAME [-tag T]... [-insecure]
//	image digest -layout LAYOUT [-platform OS/ARCH[/VARIANT]]
//	image compare -a LAYOUT -b LAYOUT [-platform OS/ARCH[/VARIANT]]
//	    (the two layouts' images of the platform: their files and config fields, compare.go;
//	    exit 1 with each difference)
//
// It is its own module, so that go-containerregistry stays out of the product's go.mod.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"time"

	"multireg.dev/multireg/hack/image/ocilayout"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "image:", err)
		os.Exit(1)
	}
}

// stringList is a repeatable flag.
type stringList []string

func (l *stringList) String() string     { return strings.Join(*l, ",") }
func (l *stringList) Set(v string) error { *l = append(*l, v); return nil }

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		return errors.New("usage: image build|push|digest|compare [flags]")
	}
	fs := flag.NewFlagSet(args[0], flag.ContinueOnError)
	fs.SetOutput(stderr)
	switch args[0] {
	case "build":
		var s spec
		var platforms string
		fs.StringVar(&s.binaries, "binaries", "", "directory holding <os>/<arch>[/<variant>]/multireg")
		fs.StringVar(&s.license, "license", "LICENSE", "the license file, copied into the image")
		fs.StringVar(&platforms, "platforms", strings.Join(defaultPlatforms, ","), "comma-separated os/arch[/variant]")
		fs.StringVar(&s.version, "version", "", "the version the binaries say (hack/version.sh), in the labels")
		tag := fs.String("tag", "", "the tag the layout's entry is named by, pushed under (default: -version with + made a dot)")
		fs.StringVar(&s.commit, "commit", "", "the commit the binaries were built from")
		fs.StringVar(&s.source, "source", "", "the repository's URL (label org.opencontainers.image.source)")
		out := fs.String("out", "", "the OCI image layout to write (replaced)")
		if err := fs.Parse(args[1:]); err != nil {
			return err
		}
		if s.binaries == "" || s.version == "" || s.commit == "" || *out == "" {
			return errors.New("build: -binaries, -version, -commit and -out are required")
		}
		s.platforms = strings.Split(platforms, ",")
		if *tag == "" {
			*tag = tagOf(s.version)
		}
		if !validTag.MatchString(*tag) {
			return fmt.Errorf("build: tag %q: a tag is [A-Za-z0-9_][A-Za-z0-9_.-]{0,127}", *tag)
		}
		created, err := sourceDateEpoch()
		if err != nil {
			return err
		}
		s.created = created
		idx, err := buildIndex(s)
		if err != nil {
			return err
		}
		if err := ocilayout.Write(*out, idx, *tag); err != nil {
			return err
		}
		return describe(stdout, idx)
	case "push":
		layoutDir := fs.String("layout", "", "the OCI image layout (make image)")
		image := fs.String("image", "", "REGISTRY/NAME to push to")
		var tags stringList
		fs.Var(&tags, "tag", "a tag to push (repeatable; default: the tag the layout names its entry by)")
		insecure := fs.Bool("insecure", os.Getenv("IMAGE_INSECURE") == "true", "plain HTTP and no TLS verification, for a registry on a test host (default from IMAGE_INSECURE=true); localhost and 127.0.0.1 speak HTTP without it")
		if err := fs.Parse(args[1:]); err != nil {
			return err
		}
		if *layoutDir == "" || *image == "" {
			return errors.New("push: -layout and -image are required")
		}
		refs, err := push(ctx, *layoutDir, *image, tags, *insecure)
		if err != nil {
			return err
		}
		for _, r := range refs {
			fmt.Fprintln(stdout, r)
		}
		return nil
	case "digest":
		layoutDir := fs.String("layout", "", "the OCI image layout")
		platform := fs.String("platform", "", "os/arch[/variant]: the digest of that platform's image instead of the index's")
		if err := fs.Parse(args[1:]); err != nil {
			return err
		}
		idx, _, err := ocilayout.Read(*layoutDir)
		if err != nil {
			return err
		}
		d, err := idx.Digest()
		if err != nil {
			return err
		}
		if *platform != "" {
			if d, err = platformDigest(idx, *platform); err != nil {
				return err
			}
		}
		fmt.Fprintln(stdout, d)
		return nil
	case "compare":
		a := fs.String("a", "", "an OCI image layout (make image's)")
		b := fs.String("b", "", "another OCI image layout (the Dockerfile's build)")
		platform := fs.String("platform", "linux/amd64", "os/arch[/variant]: the image compared, in either layout")
		if err := fs.Parse(args[1:]); err != nil {
			return err
		}
		if *a == "" || *b == "" {
			return errors.New("compare: -a and -b are required")
		}
		ia, err := imageIn(*a, *platform)
		if err != nil {
			return err
		}
		ib, err := imageIn(*b, *platform)
		if err != nil {
			return err
		}
		diffs, compared, err := compareImages(ia, ib)
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "compared %s images: %s\n", *platform, compared)
		if len(diffs) > 0 {
			for _, d := range diffs {
				fmt.Fprintln(stdout, d)
			}
			return fmt.Errorf("%s and %s: %d differences (a: %s; b: %s)", *a, *b, len(diffs), *a, *b)
		}
		fmt.Fprintln(stdout, "the same")
		return nil
	}
	return fmt.Errorf("unknown command %q: want build, push, digest or compare", args[0])
}

// validTag is what the OCI distribution spec allows as a tag.
var validTag = regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$`)

// tagOf is the tag of the image of version: a semver's build metadata (+9b9233c) joined with a
// dot instead, v0.2.0-dev+9b9233c → v0.2.0-dev.9b9233c.
func tagOf(version string) string { return strings.ReplaceAll(version, "+", ".") }

// sourceDateEpoch is the build's creation time: SOURCE_DATE_EPOCH, the reproducible-builds
// convention (the Makefile sets the commit's time).
func sourceDateEpoch() (time.Time, error) {
	v := os.Getenv("SOURCE_DATE_EPOCH")
	if v == "" {
		return time.Time{}, errors.New("SOURCE_DATE_EPOCH is not set: the image's time must come from the commit (git log -1 --format=%ct)")
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 0 {
		return time.Time{}, fmt.Errorf("SOURCE_DATE_EPOCH=%q: want seconds since 1970", v)
	}
	return time.Unix(n, 0).UTC(), nil
}
