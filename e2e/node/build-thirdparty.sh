#!/bin/sh
# build-thirdparty.sh OUTDIR MINOR: builds the third-party node plugins e2e-node runs against
# Kubernetes MINOR (1.37, 1.35, …), each at a pinned version through the Go module proxy:
#   sample-device-plugin       k8s.io/kubernetes/test/images/sample-device-plugin, of the
#                              release of MINOR pinned in kube/ (see build-kube.sh)
#   csimock                    Kubernetes' e2e mock CSI driver behind a small main (kube/csimock),
#                              of the same release, but for 1.37: the mock of v1.37.2 panics in
#                              NodePublishVolume for a new inline ephemeral volume (it keeps
#                              *csi.Volume now, and findVolNoLock's nil is dereferenced), so
#                              1.37 gets the mock of 1.36 (kube/1.36.mod), which serves it well
#   dra-example-kubeletplugin  sigs.k8s.io/dra-example-driver (thirdparty/dra/go.mod)
# and copies the dra-example-driver's demo spec and DeviceClass template next to them.
#
# Kept in OUTDIR (one per minor), rebuilt only when the pinned versions, the Go toolchain, the
# module files or csimock change (cold: about 1.5 min on two cores; cached: nothing).
set -eu
out=${1:?usage: build-thirdparty.sh OUTDIR MINOR}
minor=${2:?usage: build-thirdparty.sh OUTDIR MINOR}
here=$(cd "$(dirname "$0")" && pwd)
. "$here/stamp.sh"

case $minor in
1.37) mockminor=1.36 ;; # see above
*) mockminor=$minor ;;
esac
mf=$(kube_modfile "$minor")
mockmf=$(kube_modfile "$mockminor")
k8s=$(cd "$here/kube" && go list -modfile="$mf" -m -f '{{.Version}}' k8s.io/kubernetes)
mock=$(cd "$here/kube" && go list -modfile="$mockmf" -m -f '{{.Version}}' k8s.io/kubernetes)
dra=$(cd "$here/thirdparty/dra" && go list -m -f '{{.Version}}' sigs.k8s.io/dra-example-driver)
sum=$(cd "$here" && cat "kube/$mf" "kube/${mf%.mod}.sum" "kube/$mockmf" "kube/${mockmf%.mod}.sum" kube/csimock/*.go thirdparty/dra/go.mod thirdparty/dra/go.sum | sha256sum | cut -c1-16)
stamp="kubernetes $k8s csimock $mock dra-example-driver $dra $(go env GOVERSION) $(go env GOOS)/$(go env GOARCH) $sum"
files="sample-device-plugin csimock dra-example-kubeletplugin gpu-test1.yaml deviceclass.yaml"

if stamp_fresh "$out" "$stamp" $files; then
	echo "third-party plugins: cached in $out"
	exit 0
fi

start=$(date +%s)
(cd "$here/kube" && CGO_ENABLED=0 go build -modfile="$mf" -trimpath -ldflags "-s -w" -o "$out/" \
	k8s.io/kubernetes/test/images/sample-device-plugin)
(cd "$here/kube" && CGO_ENABLED=0 go build -modfile="$mockmf" -trimpath -ldflags "-s -w" -o "$out/" ./csimock)
(cd "$here/thirdparty/dra" && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$out/" \
	sigs.k8s.io/dra-example-driver/cmd/dra-example-kubeletplugin)
src=$(cd "$here/thirdparty/dra" && go list -m -f '{{.Dir}}' sigs.k8s.io/dra-example-driver)
cp "$src/demo/gpu-test1.yaml" "$src/deployments/helm/dra-example-driver/templates/deviceclass.yaml" "$out/"
chmod 0644 "$out/gpu-test1.yaml" "$out/deviceclass.yaml"
echo "$stamp" >"$out/.stamp"
echo "third-party plugins (kubernetes $k8s, its e2e mock CSI driver $mock, dra-example-driver $dra): built in $(( $(date +%s) - start ))s into $out"
