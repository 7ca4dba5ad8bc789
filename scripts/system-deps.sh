#!/usr/bin/env bash
# Installs the Debian packages the relay's tests (or `make serve`) use, when run as root.
# Without root it only says what is missing: the tests that need a package then say why
# they skip, and the local provider falls back as the README describes.
set -euo pipefail
mode="${1:-test}"
packages=()
command -v bwrap >/dev/null 2>&1 || packages+=(bubblewrap)
if [ "$mode" = "test" ]; then
    ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || packages+=(postgresql)
    # Static checks of the deploy recipes (tests/test_deploy.py) use these when present.
    command -v caddy >/dev/null 2>&1 || packages+=(caddy)
    command -v kubectl >/dev/null 2>&1 || packages+=(kubectl)
    docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null 2>&1 \
        || packages+=(docker-compose)
fi
[ ${#packages[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing ${packages[*]} (Debian packages)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
else
    echo "note: not installed: ${packages[*]} (run as root, or install them, to use them)" >&2
fi
