# syntax=docker/dockerfile:1
#
# relay: one image for every deploy recipe in deploy/ (compose, fly, k8s).
#
#   docker build -t relay:local .                  # every provider SDK (EXTRAS=all)
#   docker build --build-arg EXTRAS=e2b,modal -t relay:local .   # only those SDKs
#   chmod 640 tokens.toml                          # webhook secrets are in it in clear
#   docker run --rm -p 8080:8080 --env-file deploy/container.env \
#     --group-add "$(stat -c %g tokens.toml)" \
#     -v "$PWD/tokens.toml:/etc/relay/tokens.toml:ro" \
#     --security-opt seccomp=unconfined --security-opt apparmor=unconfined \
#     --security-opt systempaths=unconfined relay:local
#
# deploy/container.env is the env file made for the image (0.0.0.0, the image's paths, the
# local provider isolated or not started); .env.example is for a workstation, and the
# entrypoint refuses it in one line, as it refuses a tokens file uid 10001 cannot read.
#
# What is NOT in the image, on purpose: tokens (mount the tokens file read-only at
# /etc/relay/tokens.toml), provider keys (pass RELAY_E2B_API_KEY, RELAY_MODAL_TOKEN_*,
# RELAY_VERCEL_TOKEN ... at run time), a database (RELAY_DATABASE_URL; the SQLite default
# below only suits a single container with a volume on /var/lib/relay).
#
# The local provider and containers: bubblewrap (and passt, for jobs with egress) is
# installed, but it needs user namespaces and its own /proc, which Docker's default seccomp,
# AppArmor and masked-path settings refuse: the three --security-opt flags above allow them
# (docs/deploy.md, "bubblewrap in a container"; they weaken the container). With
# RELAY_LOCAL_ISOLATION=bwrap the relay refuses to start, naming the missing flag, rather
# than answer runs with an error. Cloud providers only (RELAY_PROVIDERS=e2b,modal,vercel)
# need none of it.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- build: a self-contained virtualenv in /opt/relay ---------------------------------
FROM ${PYTHON_IMAGE} AS build
# The extras to install: all, or a comma list of e2b, modal, vercel, daytona, sprites, exedev,
# postgres.
ARG EXTRAS=all

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

RUN python -m venv /opt/relay
WORKDIR /src
# README.md and LICENSE are part of the package metadata (pyproject's readme and
# license-files), so they are copied too.
COPY pyproject.toml README.md LICENSE ./
# The versions `make test` ran against (requirements/dev.lock), as constraints.
COPY requirements/dev.lock ./requirements/dev.lock
# Dependencies first, against an empty stand-in package: this layer is rebuilt only when
# pyproject.toml changes, not on every code change. All of them ship wheels for 3.11, so
# the slim image needs no compiler.
RUN mkdir relay && touch relay/__init__.py \
    && /opt/relay/bin/pip install -c requirements/dev.lock ".[${EXTRAS}]" \
    && rm -rf relay
COPY relay ./relay
RUN /opt/relay/bin/pip install --no-deps --force-reinstall ".[${EXTRAS}]" \
    && /opt/relay/bin/python -P -c "import relay.cli"

# --- runtime ----------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime

# bubblewrap: the local provider's sandbox (see the note at the top about containers);
# passt (pasta): the private network of a local job with egress.
# tini is not needed: relay is PID 1 and handles SIGTERM itself (drain, then cancel).
# Not pinned: Debian stable's security updates should come in with each rebuild.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap passt \
    && rm -rf /var/lib/apt/lists/*

# A fixed, non-root uid/gid so that mounted files (tokens.toml) and Kubernetes'
# runAsUser/fsGroup can refer to it.
RUN groupadd --system --gid 10001 relay \
    && useradd --system --uid 10001 --gid relay --home-dir /var/lib/relay \
       --shell /usr/sbin/nologin relay \
    && install -d -o relay -g relay -m 0750 /var/lib/relay \
    && install -d -o root -g relay -m 0755 /etc/relay

COPY --from=build /opt/relay /opt/relay
# The example job catalog ships in the image; mount your own over /etc/relay/jobs (read-only).
COPY --chown=root:root jobs /etc/relay/jobs
# Checks the env file and the tokens file before `relay serve` (one line each), then execs relay.
COPY --chmod=0755 scripts/container-entrypoint.sh /usr/local/bin/relay-entrypoint

# RELAY_TOKENS_FILE is a path, not a secret (hadolint DL3064 misreads the name).
# hadolint ignore=DL3064
ENV PATH=/opt/relay/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    RELAY_HOST=0.0.0.0 \
    RELAY_PORT=8080 \
    RELAY_TOKENS_FILE=/etc/relay/tokens.toml \
    RELAY_JOBS_DIR=/etc/relay/jobs \
    RELAY_DATABASE_URL=sqlite:////var/lib/relay/relay.db

# Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
USER 10001:10001
WORKDIR /var/lib/relay
EXPOSE 8080

# Liveness only (/healthz needs no token and no database); readiness is /readyz.
# Python's stdlib, so the image needs no curl: urlopen raises on a non-2xx answer.
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('RELAY_PORT', '8080'), timeout=4)"]

# SIGTERM starts the drain (RELAY_DRAIN_S, 20 s by default): give the container at least
# 30 s to stop (`docker stop -t 30`, compose stop_grace_period, k8s grace period).
STOPSIGNAL SIGTERM
ENTRYPOINT ["relay-entrypoint"]
CMD ["serve"]
