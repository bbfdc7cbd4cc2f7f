package faults

import (
	"flag"
	"os"

	"k8s.io/klog/v2"
)

// FAULTS_KLOG_V=5 makes kubelet's plugin manager (reconciler, operation executor) log at that
// verbosity on stderr: how the reconciler race described at soak.orphans was found.
func init() {
	if v := os.Getenv("FAULTS_KLOG_V"); v != "" {
		fs := flag.NewFlagSet("klog", flag.ContinueOnError)
		klog.InitFlags(fs)
		fs.Set("v", v)
	}
}
