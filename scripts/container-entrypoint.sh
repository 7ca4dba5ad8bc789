#!/bin/sh
# The image's entrypoint: `relay "$@"`, after refusing, in one line each, the three ways a
# container start goes wrong before the relay could say why (issue 21): a workstation env
# file (.env.example binds 127.0.0.1 and names paths in a checkout), a tokens file that was
# not mounted, and one the image's user (uid 10001) cannot read (`make serve` writes 0600).
set -eu

refuse() {
    echo "relay image: $1" >&2
    exit 2
}

if [ "${1:-}" = "serve" ]; then
    case "${RELAY_HOST:-}" in
    127.* | localhost | ::1)
        refuse "RELAY_HOST=$RELAY_HOST is unreachable from outside the container; use --env-file deploy/container.env (not .env.example), or -e RELAY_HOST=0.0.0.0" ;;
    esac
    for name in RELAY_TOKENS_FILE RELAY_JOBS_DIR; do
        eval "value=\${$name:-}"
        case "$value" in
        /*) ;;
        *) refuse "$name=$value is not a path in the image (is .env.example the --env-file?); use --env-file deploy/container.env" ;;
        esac
    done
    tokens="$RELAY_TOKENS_FILE"
    if [ ! -e "$tokens" ]; then
        refuse "no tokens file at $tokens; mount yours: -v \"\$PWD/tokens.toml:$tokens:ro\""
    fi
    if [ ! -r "$tokens" ]; then
        refuse "$tokens is not readable by uid $(id -u) (relay tokens writes it 0600); on the host: chmod 640 tokens.toml and docker run --group-add \"\$(stat -c %g tokens.toml)\" (compose: TOKENS_GID in deploy/.env), or chgrp 10001 tokens.toml && chmod 640 tokens.toml; never 644: webhook secrets are in it"
    fi
fi
exec relay "$@"
