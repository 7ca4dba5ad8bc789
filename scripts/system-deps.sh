#!/usr/bin/env bash
# Installs the Debian packages the relay's tests (or `make serve`, `make bench`) use, when
# run as root.
# Without root it only says what is missing: the tests that need a package then say why
# they skip, and the local provider falls back as the README describes.
set -euo pipefail
mode="${1:-test}"
packages=()
command -v bwrap >/dev/null 2>&1 || packages+=(bubblewrap)
# The private network of local sandboxes with egress ["*"] (pasta; slirp4netns also works).
command -v pasta >/dev/null 2>&1 || command -v slirp4netns >/dev/null 2>&1 || packages+=(passt)
if [ "$mode" = "test" ] || [ "$mode" = "bench" ]; then
    ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || packages+=(postgresql)
    # The load generator of `make bench` (and of its smoke test in tests/test_bench.py).
    command -v wrk >/dev/null 2>&1 || packages+=(wrk)
fi
if [ "$mode" = "test" ]; then
    # Static checks of the deploy recipes (tests/test_deploy.py) use these when present.
    command -v caddy >/dev/null 2>&1 || packages+=(caddy)
    command -v kubectl >/dev/null 2>&1 || packages+=(kubectl)
    docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null 2>&1 \
        || packages+=(docker-compose)
    # Renders the /docs page and drives /console headless (tests/http/test_docs_page.py,
    # tests/http/test_console.py, through Playwright with this browser: no download).
    command -v chromium >/dev/null 2>&1 || packages+=(chromium)
    # Node.js 20+ and npm: the MCP clients nobody here wrote (tests/http/test_mcp_clients.py)
    # and the Cloudflare job Worker's own tests (tests/test_cloudflare_worker.py), each
    # `npm ci` from its committed lock.
    command -v node >/dev/null 2>&1 || packages+=(nodejs)
    command -v npm >/dev/null 2>&1 || packages+=(npm)
fi
[ ${#packages[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing ${packages[*]} (Debian packages)"
    # apt takes one at a time, and another copy of the suite (another clone) may install at
    # once: `apt-get update` refuses a held lock outright, so the suites take turns on a
    # lock of their own (testing/postgres.py's install too); `install` waits for any other
    # apt (unattended upgrades) up to 10 minutes.
    exec 9>/tmp/relay-apt.lock
    flock 9
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
        --no-install-recommends "${packages[@]}" >/dev/null
else
    echo "note: not installed: ${packages[*]} (run as root, or install them, to use them)" >&2
fi
