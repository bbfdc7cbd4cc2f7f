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

# kube_modfile MINOR: the module file of kube/ that pins Kubernetes MINOR (1.37, 1.35, …):
# kube/MINOR.mod (with its MINOR.sum), or kube/go.mod when it pins that minor (the newest
# release, the default). Build with `go build -modfile=…` in kube/; fails naming the others.
# The caller sets $here, the directory of e2e/node.
kube_modfile() {
	kdir=$here/kube
	if [ -f "$kdir/$1.mod" ]; then
		echo "$1.mod"
		return 0
	fi
	newest=$(cd "$kdir" && go list -modfile=go.mod -m -f '{{.Version}}' k8s.io/kubernetes)
	case $newest in v$1.*)
		echo go.mod
		return 0
		;;
	esac
	echo "no Kubernetes $1 in kube/: go.mod pins $newest; others: $(cd "$kdir" && ls -- *.mod | grep -v '^go.mod$' | sed 's/\.mod$//' | tr '\n' ' ')" >&2
	return 1
}
