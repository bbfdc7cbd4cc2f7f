#!/bin/sh
# install-deps.sh: installs, from Debian's packages, what the single-node cluster needs and
# this machine lacks: etcd, containerd (with runc and ctr), the CNI plugins, openssl, iproute2.
# Nothing is started: the test runs its own private instances.
set -eu
need=
command -v etcd >/dev/null 2>&1 || need="$need etcd-server"
command -v containerd >/dev/null 2>&1 && command -v ctr >/dev/null 2>&1 || need="$need containerd"
[ -x /usr/sbin/runc ] || command -v runc >/dev/null 2>&1 || need="$need runc"
[ -x /usr/lib/cni/bridge ] && [ -x /usr/lib/cni/host-local ] && [ -x /usr/lib/cni/loopback ] || need="$need containernetworking-plugins"
command -v openssl >/dev/null 2>&1 || need="$need openssl"
command -v ip >/dev/null 2>&1 || need="$need iproute2"
[ -z "$need" ] && exit 0
if [ "$(id -u)" != 0 ]; then
	echo "e2e-node needs these Debian packages:$need (and root to run)" >&2
	exit 1
fi
echo "installing:$need"
apt-get update -qq
# policy-rc.d: the packages must not start their services (the test runs its own).
if [ ! -e /usr/sbin/policy-rc.d ]; then
	printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
	chmod +x /usr/sbin/policy-rc.d
	trap 'rm -f /usr/sbin/policy-rc.d' EXIT
fi
start=$(date +%s)
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $need
echo "installed in $(( $(date +%s) - start ))s"
