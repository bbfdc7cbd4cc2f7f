package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"go.yaml.in/yaml/v3"

	"multireg.dev/multireg/config"
)

const validateAbout = `Check drivers files before they reach a node: parse and validate each as multireg run
would, and print every problem with its field path. The input is a drivers file, a ConfigMap
manifest holding one (kubectl get configmap -o yaml), or a stream of manifests (helm template,
kubectl kustomize): then every ConfigMap key holding a drivers file (apiVersion
multireg.dev/v1alpha1, kind RegistrarConfig) is checked, each problem naming the document, the
ConfigMap and its key. "-" reads standard input; so does a pipe (-f <(helm template ...),
-f /dev/stdin). Runs on Linux, macOS and Windows.`

const validateFooter = `Examples:
  multireg validate --config drivers.yaml
  kubectl -n kube-system get configmap multireg -o yaml | multireg validate -f -
  helm template multireg charts/multireg -f my-values.yaml --kube-version 1.33 | multireg validate -f -
  kubectl kustomize examples/ | multireg validate -f -

Exit codes:
  0   every drivers file found is valid
  1   a drivers file is invalid (one problem per line on stderr), or none was found
  2   a usage error`

// runValidate parses and validates the drivers files of its input. It prints a one-line
// summary of each valid one and returns nil when all are; otherwise it returns every problem,
// one per line, each starting with the input's name (and the ConfigMap's).
func runValidate(_ context.Context, args []string, std stdio, helpOnly bool) error {
	var path, key string
	c := newCommand("validate", "--config FILE|- [--key KEY]", validateAbout)
	c.footer = validateFooter
	c.String(&path, "config,f,filename", "FILE", "", `the drivers file or manifests to check; "-" reads standard input (required)`)
	c.String(&key, "key", "KEY", "", "the data key of a multireg ConfigMap that holds the drivers file (default: every key holding a RegistrarConfig)")
	if err := parseOrHelp(c, args, std.out, helpOnly); err != nil {
		return err
	}
	if path == "" {
		return c.usageError("--config is required (a file, or - for standard input)")
	}
	name := path
	if path == "-" {
		name = "<stdin>"
	}
	b, err := config.ReadInput(path, std.in)
	if err != nil {
		return err
	}
	found, err := config.Extract(b, key)
	var errs []error
	if err != nil {
		errs = append(errs, prefixed(name, err))
	}
	for _, f := range found {
		where := name
		if f.Where != "" {
			where += ": " + f.Where
		}
		cfg, err := config.ParseLocal(f.Content)
		if err != nil {
			if f.Where == "" && looksLikeChartValues(f.Content) {
				values := path
				if path == "-" {
					values = "my-values.yaml"
				}
				err = fmt.Errorf("%w\nhint: this looks like the chart's values file, not a drivers file: render the chart first: helm template multireg charts/multireg -f %s --kube-version 1.33 | multireg validate -f -", err, values)
			}
			errs = append(errs, prefixed(where, err))
			continue
		}
		fmt.Fprintf(std.out, "%s: valid: %s\n", where, cfg.Summary())
	}
	return errors.Join(errs...)
}

// chartValues are the top-level keys of the chart's values (charts/multireg/values.yaml)
// that a drivers file never has.
var chartValues = []string{
	"kubeletDir", "extraHostPaths", "rollOnConfigChange", "image", "imagePullSecrets", "serviceAccount",
	"env", "nameOverride", "fullnameOverride", "httpPort", "logFormat", "logVerbosity", "cleanupOnExit",
	"podResources", "devicePluginMoves", "nodeCondition", "healthChecks",
	"extraArgs", "updateStrategy", "priorityClassName", "podAnnotations", "podLabels",
	"podSecurityContext", "securityContext", "resources", "livenessProbe", "readinessProbe",
	"terminationGracePeriodSeconds", "nodeSelector", "tolerations", "affinity", "metrics", "global",
}

// looksLikeChartValues reports whether a file given as a drivers file is rather the chart's
// values: a mapping with neither apiVersion nor kind, and drivers or a key of the chart's
// values.
func looksLikeChartValues(b []byte) bool {
	var top map[string]any
	if err := yaml.Unmarshal(b, &top); err != nil || top == nil {
		return false
	}
	if _, ok := top["apiVersion"]; ok {
		return false
	}
	if _, ok := top["kind"]; ok {
		return false
	}
	if _, ok := top["drivers"]; ok {
		return true
	}
	return slices.ContainsFunc(chartValues, func(k string) bool { _, ok := top[k]; return ok })
}

// prefixed starts every line of err with prefix.
func prefixed(prefix string, err error) error {
	return errors.New(prefix + ": " + strings.ReplaceAll(err.Error(), "\n", "\n"+prefix+": "))
}
