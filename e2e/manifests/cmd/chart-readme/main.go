// Command chart-readme writes the values table of the chart's README from its values.yaml
// (make chart-readme); a test of e2e/manifests fails while the README's table is not current.
//
//	chart-readme -chart charts/multireg
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"

	"multireg.dev/multireg/e2e/manifests/valuesdoc"
)

func main() {
	dir := flag.String("chart", "", "the chart's directory")
	flag.Parse()
	if err := run(*dir); err != nil {
		fmt.Fprintln(os.Stderr, "chart-readme:", err)
		os.Exit(1)
	}
}

func run(dir string) error {
	values, err := os.ReadFile(filepath.Join(dir, "values.yaml"))
	if err != nil {
		return err
	}
	table, err := valuesdoc.Table(values)
	if err != nil {
		return err
	}
	readme := filepath.Join(dir, "README.md")
	old, err := os.ReadFile(readme)
	if err != nil {
		return err
	}
	updated, err := valuesdoc.Update(old, table)
	if err != nil {
		return err
	}
	return os.WriteFile(readme, updated, 0o644)
}
