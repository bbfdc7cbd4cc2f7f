#!/bin/sh
# build-release.sh OUTDIR REV: builds OUTDIR/multireg from this repository's source at the git
# revision REV (an earlier release: the upgrade scenario starts from it), with that revision's
# own image build command (hack/build-binary.sh: static, stripped, stamped with its version);
# then that binary's image, OUTDIR/image, an OCI image layout built the way `make image` built
# the image under test before the node-condition agent: by hack/image as of image_tool (below),
# for this machine's platform only, named by the release's version (its tag in the test's
# registry), its time the revision's commit time, with this tree's LICENSE (the revision has
# none).
#
# Kept in OUTDIR, rebuilt only when the revision, the Go toolchain or image_tool change (cold:
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
# The image tool: hack/image of the last revision before the node-condition agent (72c0bd2).
# Since then hack/image puts /multireg-nodecond beside /multireg, and refuses a platform without
# it; the release has no agent, and its image held /multireg alone.
image_tool=790f827d4d326420f2eb55c4db9f2bda6e9f8d9e
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
mkdir "$src/.image-tool"
git -C "$root" archive --format=tar "$image_tool" hack/image | tar -x -C "$src/.image-tool"
version=$(git -C "$root" describe --tags --always "$commit")
VERSION=$version COMMIT=$(git -C "$root" rev-parse --short "$commit") \
	"$src/hack/build-binary.sh" "$out/multireg"

rm -rf "$out/platforms"
mkdir -p "$out/platforms/$platform"
cp "$out/multireg" "$out/platforms/$platform/multireg"
(cd "$src/.image-tool/hack/image" && SOURCE_DATE_EPOCH=$(git -C "$root" log -1 --format=%ct "$commit") go run . build \
	-binaries "$out/platforms" -license "$root/LICENSE" -platforms "$platform" -version "$version" -commit "$commit" \
	-source "$(sed -n 's/^SOURCE_URL *:= *//p' "$root/Makefile")" -out "$out/image") >/dev/null
rm -rf "$out/platforms"
echo "$stamp" >"$out/.stamp"
echo "multireg $rev and its image ($platform): built in $(( $(date +%s) - start ))s into $out"
