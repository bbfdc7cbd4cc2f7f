# stamp.sh: sourced by the build scripts of e2e-node. A build is kept in a directory with a
# .stamp file that says what it was built from (versions, toolchain, module files).

# stamp_fresh OUTDIR STAMP FILE...: whether OUTDIR holds every FILE, built from STAMP. When it
# does not, the old stamp is removed, so that a build cut short never looks finished.
stamp_fresh() {
	dir=$1 want=$2
	shift 2
	mkdir -p "$dir"
	if [ -f "$dir/.stamp" ] && [ "$(cat "$dir/.stamp")" = "$want" ]; then
		for f in "$@"; do [ -f "$dir/$f" ] || { rm -f "$dir/.stamp"; return 1; }; done
		return 0
	fi
	rm -f "$dir/.stamp"
	return 1
}
