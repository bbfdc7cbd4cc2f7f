// Package manifests tests what multireg ships besides its code: the Dockerfile and its build
// context, the manifests and drivers files under examples/, and the Helm chart in
// charts/multireg.
//
// It is a module of its own so that Helm's, kustomize's and BuildKit's dependencies stay out of
// the product's go.mod and cannot move the versions of the kubelet builds in e2e/go.mod. It does
// not import the product either: drivers files are checked by the multireg binary itself
// (`multireg validate`), built from the product module by the Dockerfile's own build command.
package manifests
