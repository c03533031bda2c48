#!/bin/sh
# Entry point of the coordinator image (docker/Dockerfile, target coordinator).
#
# Started as root (the image's default): copies the secrets compose mounted for the
# user edgetrain (edgetrain-install-secrets: the broker's accounts record that
# EDGETRAIN_BROKER_ACCOUNTS names, and api-token), exports that token as
# EDGETRAIN_API_TOKEN unless the environment gives one, then drops root (every
# capability, no_new_privs) and execs `edgetrain coordinator` with its own
# arguments. Started as any other user, it execs the coordinator at once.
set -eu

if [ "$(id -u)" = 0 ]; then
	edgetrain-install-secrets edgetrain
	if [ -z "${EDGETRAIN_API_TOKEN:-}" ] && [ -f /run/edgetrain/api-token ]; then
		EDGETRAIN_API_TOKEN=$(cat /run/edgetrain/api-token)
		export EDGETRAIN_API_TOKEN
	fi
	HOME=/home/edgetrain
	export HOME
	exec setpriv --reuid=edgetrain --regid=edgetrain --init-groups \
		--inh-caps=-all --bounding-set=-all --no-new-privs \
		edgetrain coordinator "$@"
fi
exec edgetrain coordinator "$@"
