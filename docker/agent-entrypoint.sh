#!/bin/sh
# Entry point of the agent image (docker/Dockerfile, target agent).
#
# 1. Shapes this container's egress to EDGETRAIN_LINK_MBPS with a tc token bucket
#    (tbf) on EDGETRAIN_LINK_IFACE (default eth0), when it runs as root in a
#    container granted NET_ADMIN. Otherwise the agent shapes its link in software
#    (--link-mbps). Latency (EDGETRAIN_LINK_LATENCY_MS) is always added by the
#    agent (--link-latency-ms): tc's netem is missing from many kernels.
# 2. Says in one line which shaping is in force.
# 3. Writes EDGETRAIN_PROFILE_JSON (a DeviceSpec) to a file the agent announces
#    (--profile), when set.
# 4. As root, copies the secrets compose mounted (this agent's credentials) for the
#    user edgetrain (edgetrain-install-secrets: to /run/edgetrain), then drops root
#    (every capability, no_new_privs) and execs `edgetrain agent` with its own
#    arguments followed by the ones above.
#
# The agent reads EDGETRAIN_<OPTION> for each of its options, EDGETRAIN_LINK_MBPS and
# EDGETRAIN_LINK_LATENCY_MS among them; this script consumes those two and unsets
# them, so that a link tc already shapes is not shaped again in the agent.
set -eu

log() {
	printf 'edgetrain-agent-entrypoint: %s\n' "$*" >&2
}

is_number() {
	case "$1" in
	'' | . | *[!0-9.]* | *.*.*) return 1 ;;
	*) return 0 ;;
	esac
}

# Token bucket depth: 10 ms of traffic at the rate (at least rate/HZ for any HZ
# >= 100, so the rate is reachable), never less than two full-size frames.
burst_bytes() {
	awk -v mbps="$1" 'BEGIN { b = int(mbps * 1e6 / 8 / 100); if (b < 3028) b = 3028; print b }'
}

iface="${EDGETRAIN_LINK_IFACE:-eth0}"
mbps="${EDGETRAIN_LINK_MBPS:-}"
latency_ms="${EDGETRAIN_LINK_LATENCY_MS:-}"

bandwidth="bandwidth unshaped"
if [ -n "$mbps" ]; then
	if ! is_number "$mbps" || [ "$(awk -v x="$mbps" 'BEGIN { print (x > 0) }')" != 1 ]; then
		log "EDGETRAIN_LINK_MBPS=$mbps: not a positive number of Mbit/s"
		exit 2
	fi
	why="not root"
	if [ "$(id -u)" = 0 ]; then
		if ! command -v tc >/dev/null 2>&1; then
			why="no tc"
		elif why=$(tc qdisc replace dev "$iface" root tbf rate "${mbps}mbit" \
			burst "$(burst_bytes "$mbps")" latency 50ms 2>&1); then
			why=""
		fi
	fi
	if [ -z "$why" ]; then
		bandwidth="bandwidth $mbps Mbit/s by tc tbf on $iface (egress)"
	else
		bandwidth="bandwidth $mbps Mbit/s in the agent (tc: $(printf '%s\n' "$why" | head -n 1))"
		set -- "$@" --link-mbps "$mbps"
	fi
fi

latency="latency unshaped"
if [ -n "$latency_ms" ]; then
	if ! is_number "$latency_ms"; then
		log "EDGETRAIN_LINK_LATENCY_MS=$latency_ms: not a number of milliseconds"
		exit 2
	fi
	latency="latency $latency_ms ms in the agent"
	set -- "$@" --link-latency-ms "$latency_ms"
fi
log "link shaping: $bandwidth; $latency"
unset EDGETRAIN_LINK_MBPS EDGETRAIN_LINK_LATENCY_MS

if [ -n "${EDGETRAIN_PROFILE_JSON:-}" ]; then
	profile="${TMPDIR:-/tmp}/edgetrain-profile.json"
	(umask 022 && printf '%s\n' "$EDGETRAIN_PROFILE_JSON" >"$profile")
	set -- "$@" --profile "$profile"
fi

if [ "$(id -u)" = 0 ]; then
	edgetrain-install-secrets edgetrain
	HOME=/home/edgetrain
	export HOME
	exec setpriv --reuid=edgetrain --regid=edgetrain --init-groups \
		--inh-caps=-all --bounding-set=-all --no-new-privs \
		edgetrain agent "$@"
fi
exec edgetrain agent "$@"
