#!/bin/sh
# build-promtool.sh [OUTDIR]: builds Prometheus's promtool, which checks and unit-tests
# multireg's alerts (e2e/monitoring/alerts_test.yaml), from the release pinned below, through
# the Go module proxy, and prints the binary's path.
#
# The binary is kept in OUTDIR (default ~/.cache/multireg/promtool), stamped with the release
# and the Go toolchain, and rebuilt only when either changes: a cold build takes about 3.5
# minutes on two cores (most of it fetching Prometheus's dependencies), a warm one nothing.
set -eu
# Prometheus 3.16.0 (its Go module numbers v3.X.Y as v0.3XX.Y).
version=v0.316.0
out=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/multireg/promtool}
here=$(cd "$(dirname "$0")" && pwd)

stamp="prometheus $version $(go env GOVERSION) $(go env GOOS)/$(go env GOARCH)"
. "$here/../node/stamp.sh"
if stamp_fresh "$out" "$stamp" promtool; then
	echo "promtool $version: cached in $out" >&2
	echo "$out/promtool"
	exit 0
fi

start=$(date +%s)
minor=${version#v0.}
release="$(( ${minor%%.*} / 100 )).$(( ${minor%%.*} % 100 )).${minor#*.}"
# Outside any module: go install pkg@version builds with Prometheus's own go.mod and go.sum,
# whatever -mod a caller's GOFLAGS says.
cd /
GOFLAGS=-mod=mod GOBIN="$out" CGO_ENABLED=0 go install -trimpath \
	-ldflags "-s -w -X github.com/prometheus/common/version.Version=$release" \
	"github.com/prometheus/prometheus/cmd/promtool@$version" >&2
echo "$stamp" >"$out/.stamp"
echo "promtool $version ($release): built in $(( $(date +%s) - start ))s into $out" >&2
echo "$out/promtool"
