#!/bin/sh
# measure-rss.sh BINARY N... — the memory figures behind the requests and limits in
# examples/daemonset.yaml and charts/multireg/values.yaml.
#
# For each N: a drivers file with N device plugins (waitForEndpoint: false, so every socket is
# published at once, with no driver and no kubelet; the endpoints' directory exists, as the
# drivers' directories do on a node), `multireg run` on it, and, once all N registration
# sockets exist, the process's CPU time so far, VmRSS, VmHWM and thread count from /proc; then
# (with curl) VmRSS again after five scrapes of /metrics and /status, as Prometheus and
# `multireg status` would do.
# Prints one line per N. Needs no root: everything lives in a temporary directory.
#
#   PORT   the HTTP port multireg serves on 127.0.0.1 (default 19809)
set -eu

if [ $# -lt 2 ]; then
	echo "usage: $0 BINARY N..." >&2
	exit 2
fi
bin=$1
shift

for n in "$@"; do
	dir=$(mktemp -d /tmp/mrss.XXXXXX)
	mkdir "$dir/ep"
	{
		printf 'apiVersion: multireg.dev/v1alpha1\nkind: RegistrarConfig\n'
		printf 'registrationDir: %s/reg\ndefaults:\n  waitForEndpoint: false\ndrivers:\n' "$dir"
		i=0
		while [ "$i" -lt "$n" ]; do
			printf '  - {name: example.com/dev-%d, type: DevicePlugin, endpoint: %s/ep/dev-%d.sock}\n' "$i" "$dir" "$i"
			i=$((i + 1))
		done
	} >"$dir/config.yaml"
	"$bin" run --config "$dir/config.yaml" --log-format json --http-endpoint "127.0.0.1:${PORT:-19809}" 2>"$dir/log" &
	pid=$!
	start=$(date +%s%N)
	# Poll (no fixed sleep): done when N sockets exist, give up after 60 s.
	while [ "$(find "$dir/reg" -maxdepth 1 -type s -name '*-reg.sock' 2>/dev/null | wc -l)" -lt "$n" ]; do
		if ! kill -0 "$pid" 2>/dev/null; then
			echo "multireg exited:" >&2
			cat "$dir/log" >&2
			exit 1
		fi
		if [ $(($(date +%s%N) - start)) -gt 60000000000 ]; then
			echo "timeout waiting for $n sockets" >&2
			kill "$pid"
			exit 1
		fi
		sleep 0.01
	done
	ready_ms=$((($(date +%s%N) - start) / 1000000))
	rss=$(awk '/^VmRSS/ {print $2}' "/proc/$pid/status")
	hwm=$(awk '/^VmHWM/ {print $2}' "/proc/$pid/status")
	threads=$(awk '/^Threads/ {print $2}' "/proc/$pid/status")
	# utime + stime, in clock ticks (fields 14 and 15 of /proc/PID/stat; the command name has no spaces).
	ticks=$(awk '{print $14 + $15}' "/proc/$pid/stat")
	cpu_ms=$((ticks * 1000 / $(getconf CLK_TCK)))
	scraped=-
	if command -v curl >/dev/null; then
		for _ in 1 2 3 4 5; do
			curl -fsS -o /dev/null "http://127.0.0.1:${PORT:-19809}/metrics"
			curl -fsS -o /dev/null "http://127.0.0.1:${PORT:-19809}/status"
		done
		scraped=$(awk '/^VmRSS/ {print $2}' "/proc/$pid/status")
	fi
	echo "drivers=$n sockets_ready_ms=$ready_ms cpu_ms=$cpu_ms rss_kib=$rss peak_rss_kib=$hwm threads=$threads rss_after_scrapes_kib=$scraped"
	kill -TERM "$pid"
	wait "$pid" || true
	rm -rf "$dir"
done
