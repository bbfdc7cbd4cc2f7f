#!/bin/sh
# dockerfile-check.sh LAYOUT — builds the Dockerfile with buildah for linux/amd64 and compares
# the image, file by file and config field by config field, with the linux/amd64 image of the
# OCI image layout LAYOUT (make image's, hack/image's build): `make dockerfile-check`.
#
#   VERSION, COMMIT, REVISION, SOURCE_DATE_EPOCH, CREATED   what LAYOUT was built with (the
#                      Makefile passes its own); the Dockerfile's build arguments
#   GO                 the go command whose toolchain builds the binary (default: go)
#   STORAGE_DRIVER     buildah's storage driver (default overlay, and vfs where overlay
#                      cannot mount, e.g. in some containers)
#
# No registry is reached. The Dockerfile's builder stage runs FROM localhost/go-builder, an
# image this script makes from scratch: busybox (Debian's busybox-static: the shell and tools
# the build runs) and the environment of Go's images (GOPATH=/go, GOTOOLCHAIN=local, PATH with
# /usr/local/go/bin). Its Go toolchain is this machine's, $(go env GOROOT), mounted read-only
# at /usr/local/go into every RUN of the build — the toolchain `make image` builds with, so
# that the binaries can be the same bytes, and 270 MB that need not be copied into an image.
# The modules come from this machine's module cache, filled first by `go mod download` (through
# the Go module proxy) and mounted read-only at /go/pkg/mod with GOPROXY=off; the build cache
# is this machine's too, $(go env GOCACHE), mounted at the builder's (/root/.cache/go-build):
# a cache changes no byte of what go builds (make image's binary, just built, comes from it),
# and a cold build of the binary takes minutes on two cores. The final stage is FROM scratch. buildah runs as root, without a daemon, with chroot isolation (no OCI
# runtime); its storage is a directory of its own under bin/, removed at the end.
set -eu
usage="usage: dockerfile-check.sh LAYOUT"
layout=${1:?$usage}
case $layout in
/*) ;;
*) layout=$(pwd)/$layout ;;
esac
cd "$(dirname "$0")/.."
: "${VERSION:?}" "${COMMIT:?}" "${REVISION:?}" "${SOURCE_DATE_EPOCH:?}" "${CREATED:?}"
go=${GO:-go}

for tool in buildah busybox; do
	if ! command -v $tool >/dev/null 2>&1; then
		echo "dockerfile-check: no $tool (Debian: apt-get install buildah busybox-static)" >&2
		exit 1
	fi
done
busybox=$(command -v busybox)
if ldd "$busybox" >/dev/null 2>&1; then
	echo "dockerfile-check: $busybox is linked dynamically; the builder's base has no libc (Debian: busybox-static)" >&2
	exit 1
fi

work=$(pwd)/bin/dockerfile-check
driver=${STORAGE_DRIVER:-overlay}
b="buildah --root $work/storage --runroot $work/run --storage-driver $driver"
cleanup() {
	$b rm --all >/dev/null 2>&1 || true
	$b rmi --all --force >/dev/null 2>&1 || true
	rm -rf "$work"
}
rm -rf "$work"
mkdir -p "$work"
trap cleanup EXIT
start=$(date +%s)

# The builder's base: busybox and Go's environment, nothing pulled.
goroot=$($go env GOROOT)
ctr=$($b from scratch)
if ! mnt=$($b mount "$ctr" 2>"$work/mount.log"); then
	if [ -n "${STORAGE_DRIVER:-}" ]; then
		cat "$work/mount.log" >&2
		exit 1
	fi
	# overlay cannot mount here (in some containers): vfs copies instead, and always mounts.
	echo "dockerfile-check: overlay does not mount here ($(tail -n 1 "$work/mount.log")); vfs instead" >&2
	cleanup
	mkdir -p "$work"
	driver=vfs
	b="buildah --root $work/storage --runroot $work/run --storage-driver $driver"
	ctr=$($b from scratch)
	mnt=$($b mount "$ctr")
fi
mkdir -p "$mnt/bin" "$mnt/tmp" "$mnt/root" "$mnt/go" "$mnt/usr/local/go"
chmod 1777 "$mnt/tmp"
cp "$busybox" "$mnt/bin/busybox"
for applet in $("$busybox" --list); do
	[ "$applet" = busybox ] || ln -s busybox "$mnt/bin/$applet"
done
$b umount "$ctr" >/dev/null
$b config --env PATH=/go/bin:/usr/local/go/bin:/bin --env HOME=/root --env GOPATH=/go --env GOTOOLCHAIN=local \
	--workingdir /go "$ctr"
$b commit -q "$ctr" localhost/go-builder >/dev/null
$b rm "$ctr" >/dev/null
echo "dockerfile-check: localhost/go-builder (busybox; $($go env GOVERSION) from $goroot) in $(($(date +%s) - start))s"

# The modules, from the proxy into this machine's cache, then read-only into the build.
$go mod download
modcache=$($go env GOMODCACHE)
gocache=$($go env GOCACHE)

# --timestamp: the creation time and every file's time the commit's (what hack/image writes);
# --identity-label=false: no io.buildah.version label; --unsetenv PATH: no PATH, which buildah
# (as BuildKit) gives an image FROM scratch by default and hack/image does not (the image has
# no program to find: multireg runs none).
if ! $b bud --isolation chroot --pull=never --platform linux/amd64 \
	--timestamp "$SOURCE_DATE_EPOCH" --identity-label=false --unsetenv PATH \
	--build-arg GO_IMAGE=localhost/go-builder --build-arg GOPROXY=off \
	--build-arg VERSION="$VERSION" --build-arg COMMIT="$COMMIT" --build-arg REVISION="$REVISION" \
	--build-arg SOURCE_DATE_EPOCH="$SOURCE_DATE_EPOCH" --build-arg CREATED="$CREATED" \
	--volume "$goroot:/usr/local/go:ro" --volume "$modcache:/go/pkg/mod:ro" --volume "$gocache:/root/.cache/go-build" \
	--tag localhost/multireg:dockerfile-check --file Dockerfile . >"$work/bud.log" 2>&1; then
	cat "$work/bud.log" >&2
	exit 1
fi
$b push --quiet localhost/multireg:dockerfile-check "oci:$work/oci:dockerfile-check"
echo "dockerfile-check: the Dockerfile built with $(buildah --version | cut -d' ' -f1-3) in $(($(date +%s) - start))s"

(cd hack/image && $go run . compare -a "$layout" -b "$work/oci" -platform linux/amd64)
echo "dockerfile-check: done in $(($(date +%s) - start))s"
