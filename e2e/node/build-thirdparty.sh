#!/bin/sh
# build-thirdparty.sh OUTDIR: builds the third-party node plugins e2e-node runs, each at a
# pinned version through the Go module proxy:
#   sample-device-plugin       k8s.io/kubernetes/test/images/sample-device-plugin (kube/go.mod)
#   csimock                    Kubernetes' e2e mock CSI driver behind a small main (kube/csimock)
#   dra-example-kubeletplugin  sigs.k8s.io/dra-example-driver (thirdparty/dra/go.mod)
# and copies the dra-example-driver's demo spec and DeviceClass template next to them.
#
# Kept in OUTDIR, rebuilt only when the pinned versions, the Go toolchain, the module files or
# csimock change (cold: about 1.5 min on two cores; cached: nothing).
set -eu
out=${1:?usage: build-thirdparty.sh OUTDIR}
here=$(cd "$(dirname "$0")" && pwd)

k8s=$(cd "$here/kube" && go list -m -f '{{.Version}}' k8s.io/kubernetes)
dra=$(cd "$here/thirdparty/dra" && go list -m -f '{{.Version}}' sigs.k8s.io/dra-example-driver)
sum=$(cd "$here" && cat kube/go.mod kube/go.sum kube/csimock/*.go thirdparty/dra/go.mod thirdparty/dra/go.sum | sha256sum | cut -c1-16)
stamp="kubernetes $k8s dra-example-driver $dra $(go env GOVERSION) $(go env GOOS)/$(go env GOARCH) $sum"
files="sample-device-plugin csimock dra-example-kubeletplugin gpu-test1.yaml deviceclass.yaml"

. "$here/stamp.sh"
if stamp_fresh "$out" "$stamp" $files; then
	echo "third-party plugins: cached in $out"
	exit 0
fi

start=$(date +%s)
(cd "$here/kube" && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$out/" \
	k8s.io/kubernetes/test/images/sample-device-plugin ./csimock)
(cd "$here/thirdparty/dra" && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$out/" \
	sigs.k8s.io/dra-example-driver/cmd/dra-example-kubeletplugin)
src=$(cd "$here/thirdparty/dra" && go list -m -f '{{.Dir}}' sigs.k8s.io/dra-example-driver)
cp "$src/demo/gpu-test1.yaml" "$src/deployments/helm/dra-example-driver/templates/deviceclass.yaml" "$out/"
chmod 0644 "$out/gpu-test1.yaml" "$out/deviceclass.yaml"
echo "$stamp" >"$out/.stamp"
echo "third-party plugins (kubernetes $k8s, dra-example-driver $dra): built in $(( $(date +%s) - start ))s into $out"
