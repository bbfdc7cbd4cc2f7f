#!/bin/sh
# build-release.sh OUTDIR REV: builds OUTDIR/multireg from this repository's source at the git
# revision REV (an earlier release: the upgrade scenario starts from it), with that revision's
# own image build command (hack/build-binary.sh: static, stripped, stamped with its version).
#
# Kept in OUTDIR, rebuilt only when the revision or the Go toolchain change (cold: about 30 s
# on two cores; cached: nothing).
set -eu
usage="usage: build-release.sh OUTDIR REV"
out=${1:?$usage}
rev=${2:?$usage}
here=$(cd "$(dirname "$0")" && pwd)
root=$(git -C "$here" rev-parse --show-toplevel)

commit=$(git -C "$root" rev-parse --verify "$rev^{commit}")
stamp="multireg $commit $(go env GOVERSION) $(go env GOOS)/$(go env GOARCH)"

. "$here/stamp.sh"
if stamp_fresh "$out" "$stamp" multireg; then
	echo "multireg $rev: cached in $out"
	exit 0
fi

start=$(date +%s)
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
git -C "$root" archive --format=tar "$commit" | tar -x -C "$src"
VERSION=$(git -C "$root" describe --tags --always "$commit") COMMIT=$(git -C "$root" rev-parse --short "$commit") \
	"$src/hack/build-binary.sh" "$out/multireg"
echo "$stamp" >"$out/.stamp"
echo "multireg $rev: built in $(( $(date +%s) - start ))s into $out"
