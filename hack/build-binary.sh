#!/bin/sh
# build-binary.sh OUTPUT — the one command that builds the multireg binaries shipped in the
# image: multireg at OUTPUT, and its node-condition agent, the one that links the Kubernetes
# API client, at OUTPUT-nodecond (multireg-nodecond beside multireg, where multireg looks for
# it). `make build`, `make binaries` (every platform of the image) and CI run it, so the
# image's binaries are the ones CI builds.
#
#   VERSION           stamped into `multireg version` and multireg_build_info (default: what
#                     hack/version.sh says: the VERSION file's on its release tag, else a
#                     pre-release of it with the commit, v0.2.0-dev+9b9233c)
#   COMMIT            the commit, stamped beside it (default: hack/version.sh's, the short
#                     commit, -dirty when the tracked files changed; unknown without git)
#   GO                the go command (default: go)
#   GOOS, GOARCH      cross-compile, as for go build; GOARM (arm), GOAMD64, GOARM64, GOPPC64
#                     default to the baseline of each architecture, so that an environment's
#                     setting never changes the bytes (make binaries sets GOARM=7)
#   EXTRA_TAGS        build tags added to grpcnotrace, comma-separated: make faults-check
#                     builds the fault-injecting build (multireg_faults) with the same flags, so
#                     that it is compiled from the same cached packages; never set for a release
#
# Static (CGO_ENABLED=0: the image has no libc), stripped (-s -w) and reproducible: -trimpath
# (no path of the build machine), -buildvcs=false (the commit is stamped explicitly, never read
# from the checkout's state), no cgo. The same commit, VERSION and Go toolchain give the same
# bytes on any machine and in any directory.
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
version=${VERSION:-$(hack/version.sh)}
commit=${COMMIT:-$(hack/version.sh commit)}
build() {
	CGO_ENABLED=0 GOFLAGS='' GOAMD64=${GOAMD64:-v1} GOARM=${GOARM:-7} GOARM64=${GOARM64:-v8.0} GOPPC64=${GOPPC64:-power8} \
		"${GO:-go}" build -trimpath -buildvcs=false -tags "grpcnotrace${EXTRA_TAGS:+,$EXTRA_TAGS}" \
		-ldflags "-s -w -X main.version=$version -X main.commit=$commit" \
		-o "$1" "$2"
}
build "$out" ./cmd/multireg
build "$out-nodecond" ./cmd/multireg-nodecond
