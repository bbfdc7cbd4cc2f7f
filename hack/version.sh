#!/bin/sh
# version.sh [version|commit|revision] — what a build of this tree says it is: its version (in
# the binary's `multireg version` and multireg_build_info, the image's labels and, with + made
# a dot, the image's tag), its commit (short, in the binary) or its revision (the whole commit,
# in the image's labels); the commit and revision end in -dirty when the tracked files differ
# from HEAD's, and are "unknown" without git. The Makefile and hack/build-binary.sh ask it;
# its test is e2e/manifests' TestVersionScript.
#
# The VERSION file names the release this tree is, or the one it leads to (semver with a
# leading v). A release build prints it as it is:
#   - HEAD is the tag named VERSION and the tracked files are the commit's, or
#   - RELEASE=1 (the release workflow; or a build of a release's source without git): the
#     tracked files must then be HEAD's, where there is a HEAD.
# Any other build is a pre-release of VERSION, with its commit as build metadata (semver):
#   v0.2.0-dev+9b9233c        a commit that is not the release's tag
#   v0.2.0-dev+9b9233c-dirty  its tracked files changed
#   v0.2.0+9b9233c-dirty      the release's tag, its tracked files changed
#   v0.2.0-dev+unknown        no git, or not a checkout
set -eu
cd "$(dirname "$0")/.."
version=$(cat VERSION)
commit=$(git rev-parse --short HEAD 2>/dev/null) || commit=
dirty=
if [ -n "$commit" ] && ! git diff --quiet HEAD -- 2>/dev/null; then
	dirty=-dirty
fi
case ${1:-version} in
version) ;;
commit)
	echo "${commit:-unknown}$dirty"
	exit 0
	;;
revision)
	echo "$(git rev-parse HEAD 2>/dev/null || echo unknown)$dirty"
	exit 0
	;;
*)
	echo "usage: $0 [version|commit|revision]" >&2
	exit 2
	;;
esac
tagged=
if [ -n "$commit" ] && git tag --points-at HEAD 2>/dev/null | grep -qxF "$version"; then
	tagged=1
fi

if [ "${RELEASE:-}" = 1 ]; then
	if [ -n "$dirty" ]; then
		echo "version.sh: RELEASE=1, but the tracked files differ from HEAD ($commit): a release is built from its commit" >&2
		exit 1
	fi
	echo "$version"
elif [ -n "$tagged" ] && [ -z "$dirty" ]; then
	echo "$version"
elif [ -n "$tagged" ]; then
	echo "$version+$commit$dirty"
else
	echo "$version-dev+${commit:-unknown}$dirty"
fi
