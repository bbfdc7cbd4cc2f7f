#!/bin/sh
# build-release.sh OUTDIR REV: builds OUTDIR/multireg from this repository's source at the git
# revision REV (an earlier release: the upgrade scenario starts from it), with that revision's
# own image build command (hack/build-binary.sh: static, stripped, stamped with its version);
# then that binary's image, OUTDIR/image, an OCI image layout built the way `make image` builds
# the image under test: by this tree's hack/image, for this machine's platform only, named by
# the release's version (its tag in the test's registry), its time the revision's commit time,
# with this tree's LICENSE (the revision has none).
#
# Kept in OUTDIR, rebuilt only when the revision, the Go toolchain or hack/image change (cold:
# about 30 s on two cores; cached: nothing).
set -eu
usage="usage: build-release.sh OUTDIR REV"
out=${1:?$usage}
rev=${2:?$usage}
here=$(cd "$(dirname "$0")" && pwd)
root=$(git -C "$here" rev-parse --show-toplevel)

commit=$(git -C "$root" rev-parse --verify "$rev^{commit}")
arch=$(go env GOARCH)
platform=linux/$arch
if [ "$arch" = arm ]; then platform=linux/arm/v7; fi
image_tool=$(cat "$root"/hack/image/*.go "$root"/hack/image/go.mod "$root"/hack/image/go.sum | sha256sum | cut -c1-16)
stamp="multireg $commit $(go env GOVERSION) $(go env GOOS)/$arch image $image_tool"

. "$here/stamp.sh"
if stamp_fresh "$out" "$stamp" multireg image/index.json; then
	echo "multireg $rev and its image: cached in $out"
	exit 0
fi

start=$(date +%s)
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
git -C "$root" archive --format=tar "$commit" | tar -x -C "$src"
version=$(git -C "$root" describe --tags --always "$commit")
VERSION=$version COMMIT=$(git -C "$root" rev-parse --short "$commit") \
	"$src/hack/build-binary.sh" "$out/multireg"

rm -rf "$out/platforms"
mkdir -p "$out/platforms/$platform"
cp "$out/multireg" "$out/platforms/$platform/multireg"
(cd "$root/hack/image" && SOURCE_DATE_EPOCH=$(git -C "$root" log -1 --format=%ct "$commit") go run . build \
	-binaries "$out/platforms" -license "$root/LICENSE" -platforms "$platform" -version "$version" -commit "$commit" \
	-source "$(sed -n 's/^SOURCE_URL *:= *//p' "$root/Makefile")" -out "$out/image") >/dev/null
rm -rf "$out/platforms"
echo "$stamp" >"$out/.stamp"
echo "multireg $rev and its image ($platform): built in $(( $(date +%s) - start ))s into $out"
