package main

import (
	"context"
	"encoding/json"
	"fmt"
	"runtime"

	"go.yaml.in/yaml/v3"
)

// Set at build time: go build -ldflags "-X main.version=v0.1.0 -X main.commit=abc123".
var (
	version = "devel"
	commit  = "unknown"
)

// versionInfo is `multireg version -o json|yaml`.
type versionInfo struct {
	Version   string `json:"version" yaml:"version"`
	Commit    string `json:"commit" yaml:"commit"`
	GoVersion string `json:"goVersion" yaml:"goVersion"`
	Platform  string `json:"platform" yaml:"platform"`
}

func runVersion(_ context.Context, args []string, std stdio, helpOnly bool) error {
	stdout := std.out
	var output string
	c := newCommand("version", "[-o json|yaml]", "Print multireg's version, the commit it was built from, its Go version and platform.")
	c.String(&output, "o,output", "FORMAT", "", "output format: json or yaml (default: one line)")
	if err := parseOrHelp(c, args, stdout, helpOnly); err != nil {
		return err
	}
	v := versionInfo{Version: version, Commit: commit, GoVersion: runtime.Version(), Platform: runtime.GOOS + "/" + runtime.GOARCH}
	switch output {
	case "":
		_, err := fmt.Fprintf(stdout, "multireg %s (commit %s, %s, %s)\n", v.Version, v.Commit, v.GoVersion, v.Platform)
		return err
	case "json":
		b, _ := json.MarshalIndent(v, "", "  ")
		_, err := fmt.Fprintf(stdout, "%s\n", b)
		return err
	case "yaml":
		b, _ := yaml.Marshal(v)
		_, err := stdout.Write(b)
		return err
	}
	return c.usageError("-o %q: must be json or yaml", output)
}
