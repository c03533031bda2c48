#!/bin/sh
# edgetrain-install-secrets USER: what the edgetrain images' entry points run as root
# before they drop to USER (docker/Dockerfile).
#
# `edgetrain testbed compose` mounts a service's part of its secrets read-only at
# /run/secrets/edgetrain: files of whoever rendered them, mode 0600, which USER cannot
# read. This copies them to /run/edgetrain, owned by USER and private to it (mode 0700
# and 0600). With nothing mounted there it does nothing; an empty mount (the secrets
# were never made, so Docker made an empty directory) is an error.
set -eu

src=/run/secrets/edgetrain
dst=/run/edgetrain
user="$1"

[ -d "$src" ] || exit 0
if [ -z "$(ls -A "$src")" ]; then
	printf 'edgetrain-install-secrets: %s is empty: make the secrets with edgetrain testbed compose\n' \
		"$src" >&2
	exit 2
fi
rm -rf "$dst"
mkdir -p "$dst"
cp -R "$src/." "$dst/"
chown -R "$user:" "$dst"  # and its login group
chmod -R go= "$dst"
