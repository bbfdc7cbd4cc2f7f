// Command chart-package packages the Helm chart as helm package does (Helm's own Go library),
// without a helm binary: make chart and the release workflow run it.
//
//	chart-package -chart charts/multireg -out bin/chart
//
// It prints the package's path, <out>/<name>-<version>.tgz.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"

	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
)

func main() {
	if err := run(os.Args[1:], os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "chart-package:", err)
		os.Exit(1)
	}
}

func run(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("chart-package", flag.ContinueOnError)
	fs.SetOutput(stderr)
	dir := fs.String("chart", "", "the chart's directory")
	out := fs.String("out", "", "the directory to write the package to")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *dir == "" || *out == "" {
		return errors.New("-chart and -out are required")
	}
	c, err := loader.LoadDir(*dir)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(*out, 0o755); err != nil {
		return err
	}
	path, err := chartutil.Save(c, *out)
	if err != nil {
		return err
	}
	fmt.Fprintln(stdout, path)
	return nil
}
