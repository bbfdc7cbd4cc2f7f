#!/bin/sh
# build-kube.sh OUTDIR MINOR [COMMAND...]: builds the Kubernetes commands e2e-node runs
# (kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kubectl), or the
# COMMANDs named (the node-condition suites need kube-apiserver alone), from the release
# of minor MINOR (1.37, 1.35, …) pinned in kube/ (kube/go.mod for the newest,
# kube/MINOR.mod for the others), through the Go module proxy.
#
# The binaries are kept in OUTDIR (one per minor), stamped with the release so that
# they report it (without -ldflags they say v0.0.0), and rebuilt only when the
# release, the Go toolchain or its module files change: a cold build takes minutes on
# two cores, a warm one nothing.
set -eu
out=${1:?usage: build-kube.sh OUTDIR MINOR}
minor=${2:?usage: build-kube.sh OUTDIR MINOR}
shift 2
cmds=${*:-kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl}
here=$(cd "$(dirname "$0")" && pwd)
. "$here/stamp.sh"
mf=$(kube_modfile "$minor")
cd "$here/kube"

version=$(go list -modfile="$mf" -m -f '{{.Version}}' k8s.io/kubernetes)
# The stamp: the release, the toolchain, and the module files (a changed replace rebuilds).
stamp="$version [$cmds] $(go env GOVERSION) $(go env GOOS)/$(go env GOARCH) $(cat "$mf" "${mf%.mod}.sum" | sha256sum | cut -c1-16)"

if stamp_fresh "$out" "$stamp" $cmds; then
	echo "kubernetes $version: cached in $out"
	exit 0
fi

start=$(date +%s)
pkgs=
for c in $cmds; do pkgs="$pkgs k8s.io/kubernetes/cmd/$c"; done
# gitTreeState and buildDate are set for `kubectl version` and /version.
CGO_ENABLED=0 go build -modfile="$mf" -trimpath -o "$out/" \
	-ldflags "-s -w -X k8s.io/component-base/version.gitVersion=$version -X k8s.io/component-base/version.gitTreeState=clean -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$(echo "$version" | cut -d. -f2)" \
	$pkgs
echo "$stamp" >"$out/.stamp"
echo "kubernetes $version: built in $(( $(date +%s) - start ))s into $out"
