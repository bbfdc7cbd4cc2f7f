// Package manifests tests what multireg ships besides its code: the binary as the image gets it,
// the one version (VERSION, the chart, the CHANGELOG, the examples), the manifests and drivers
// files under examples/, and the Helm chart in charts/multireg with its README's values table.
//
// It is a module of its own so that Helm's and kustomize's dependencies stay out of the
// product's go.mod and cannot move the versions of the kubelet builds in e2e/go.mod. It does
// not import the product either: drivers files are checked by the multireg binary itself
// (`multireg validate`), built from the product module by hack/build-binary.sh, the command
// that builds the image's binaries.
package manifests
