#!/bin/sh
# build-binary.sh OUTPUT — the one command that builds the multireg binary shipped in the image.
# The Dockerfile's build stage runs it, and so does CI, so the image's binary is known to build.
#
#   VERSION, COMMIT   stamped into `multireg version` (default: devel, unknown)
#   GO                the go command (default: go)
#   GOOS, GOARCH      cross-compile, as for go build (the Dockerfile sets them for each platform)
#
# Static (CGO_ENABLED=0: the image has no libc), reproducible (-trimpath), stripped (-s -w).
# -tags grpcnotrace leaves out gRPC's request tracing (golang.org/x/net/trace, with
# html/template), which multireg never turns on or serves: the binary is 2.8 MB smaller, and
# 2.4 MiB less of it is resident (BENCHMARKS.md). e2e/mrproc and e2e/cmd/bench build the same.
set -eu

if [ $# -ne 1 ]; then
	echo "usage: $0 OUTPUT" >&2
	exit 2
fi
out=$1
case $out in
/*) ;;
*) out=$(pwd)/$out ;;
esac

cd "$(dirname "$0")/.."
CGO_ENABLED=0 exec "${GO:-go}" build -trimpath -tags grpcnotrace \
	-ldflags "-s -w -X main.version=${VERSION:-devel} -X main.commit=${COMMIT:-unknown}" \
	-o "$out" ./cmd/multireg
