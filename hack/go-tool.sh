#!/bin/sh
# go-tool.sh NAME MODULE/PATH@VERSION: builds a Go tool the checks need (actionlint, govulncheck,
# cyclonedx-gomod) from the Go module proxy at the pinned version, keeps it in
# ~/.cache/multireg/NAME/, and prints the binary's path. It is built again only when the
# version or the Go toolchain changes: a cold build costs a minute or so, a warm one nothing.
# The tools stay out of every go.mod of the repository: go install pkg@version builds each
# with its own go.mod and go.sum.
set -eu
if [ $# -ne 2 ]; then
	echo "usage: $0 NAME MODULE/PATH@VERSION" >&2
	exit 2
fi
name=$1 pkg=$2
out=${XDG_CACHE_HOME:-$HOME/.cache}/multireg/$name
stamp="$pkg $(go env GOVERSION) $(go env GOOS)/$(go env GOARCH)"
if [ -x "$out/$name" ] && [ -f "$out/.stamp" ] && [ "$(cat "$out/.stamp")" = "$stamp" ]; then
	echo "$out/$name"
	exit 0
fi
mkdir -p "$out"
rm -f "$out/.stamp"
start=$(date +%s)
# Outside any module, so that the tool's own go.mod decides, whatever GOFLAGS says.
cd /
GOFLAGS=-mod=mod GOBIN="$out" CGO_ENABLED=0 go install -trimpath -ldflags "-s -w" "$pkg" >&2
echo "$stamp" >"$out/.stamp"
echo "$name: built $pkg in $(( $(date +%s) - start ))s into $out" >&2
echo "$out/$name"
