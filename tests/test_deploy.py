"""Static checks of the deploy recipes: Dockerfile, compose + Caddy, fly.toml, systemd, k8s.

Every file is parsed and checked for the fields that matter (image, probes, resources,
secrets only from secret stores, drain-matched stop timeouts). Where the real tool is on the
machine it gets the last word — ``docker compose config``, ``caddy adapt``,
``systemd-analyze verify``/``security``, ``kubectl kustomize`` — and where it is not, that
test says skipped and why. Nothing here needs a daemon, a cluster or the network.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import tomllib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from relay.settings import Settings
from testing.postgres import temp_base
from testing.relay_server import free_port

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DRAIN_S = float(Settings.model_fields["drain_s"].default)
RELAYS = ("relay-1", "relay-2")
TOOL_TIMEOUT_S = 60


def _secret_settings() -> set[str]:
    """Env names of the settings that are secrets: every SecretStr, and the database URL."""
    names = {
        f"RELAY_{name.upper()}"
        for name, field in Settings.model_fields.items()
        if "SecretStr" in str(field.annotation)
    }
    return names | {"RELAY_DATABASE_URL"}


SECRETS = _secret_settings()


def _run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, check=False, **kwargs
    )


# --- Dockerfile ---------------------------------------------------------------------------


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = pending + line
        pending = ""
        keyword, _, rest = full.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
    return instructions


def _final_stage() -> list[tuple[str, str]]:
    instructions = _dockerfile_instructions()
    last_from = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    return instructions[last_from:]


def _healthcheck_argv() -> list[str]:
    [health] = [args for keyword, args in _final_stage() if keyword == "HEALTHCHECK"]
    _, _, command = health.partition("CMD ")
    argv = json.loads(command)
    assert isinstance(argv, list)
    return [str(part) for part in argv]


def test_dockerfile_base_is_slim_python_311() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim", text, re.MULTILINE)
    froms = [args for keyword, args in _dockerfile_instructions() if keyword == "FROM"]
    assert froms and all(args.startswith("${PYTHON_IMAGE}") for args in froms)


def test_dockerfile_installs_the_chosen_extras_from_the_lock_and_bubblewrap() -> None:
    instructions = _dockerfile_instructions()
    assert ("ARG", "EXTRAS=all") in instructions
    runs = " ".join(args for keyword, args in instructions if keyword == "RUN")
    assert re.search(r"pip install -c requirements/dev\.lock \"\.\[\$\{EXTRAS\}\]\"", runs)
    assert "[all]" not in runs, "an install that ignores EXTRAS"
    final_runs = " ".join(args for keyword, args in _final_stage() if keyword == "RUN")
    assert re.search(r"apt-get install .*\bbubblewrap\b", final_runs)
    assert re.search(r"apt-get install .*\bpasst\b", final_runs), "no pasta for egress"


def test_dockerfile_runs_as_non_root() -> None:
    users = [args for keyword, args in _final_stage() if keyword == "USER"]
    assert users, "the final stage sets no USER, so it runs as root"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}


def test_dockerfile_serves_on_8080_with_relay_entrypoint() -> None:
    final = _final_stage()
    assert ("EXPOSE", "8080") in final
    assert ("ENTRYPOINT", '["relay-entrypoint"]') in final
    assert any(
        keyword == "COPY"
        and args.endswith("scripts/container-entrypoint.sh /usr/local/bin/relay-entrypoint")
        for keyword, args in final
    )
    assert ("CMD", '["serve"]') in final
    env = " ".join(args for keyword, args in final if keyword == "ENV")
    assert "RELAY_HOST=0.0.0.0" in env
    assert "RELAY_TOKENS_FILE=/etc/relay/tokens.toml" in env


def test_dockerfile_bakes_no_secret_and_no_tokens() -> None:
    for keyword, args in _dockerfile_instructions():
        if keyword in {"ENV", "ARG"}:
            for name in SECRETS - {"RELAY_DATABASE_URL"}:
                assert name not in args, f"{keyword} {args}"
            assert not re.search(r"postgresql[^ ]*://[^ ]*:[^ ]*@", args), "a password in ENV"
        if keyword in {"COPY", "ADD"}:
            assert "tokens.toml" not in args and ".env" not in args, f"{keyword} {args}"


def test_dockerignore_keeps_secrets_out_and_build_inputs_in() -> None:
    patterns = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".env", "tokens.toml", ".git"} <= patterns
    copied = set()
    for keyword, args in _dockerfile_instructions():
        if keyword == "COPY" and "--from=" not in args:
            sources = [part for part in args.split() if not part.startswith("--")][:-1]
            copied.update(sources)
    assert {"pyproject.toml", "README.md", "relay", "jobs", "requirements/dev.lock"} <= copied
    assert "scripts/container-entrypoint.sh" in copied
    assert not copied & patterns, "the Dockerfile copies something .dockerignore drops"


def test_dockerfile_healthcheck_uses_stdlib_on_healthz() -> None:
    argv = _healthcheck_argv()
    assert argv[0] == "python" and "urllib.request" in argv[-1] and "/healthz" in argv[-1]
    assert not any("curl" in part or "wget" in part for part in argv)


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(("status", "healthy"), [(200, True), (503, False)])
def test_dockerfile_healthcheck_command_really_checks(
    health_server: ThreadingHTTPServer, status: int, healthy: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run the HEALTHCHECK's own command against a local /healthz that answers ``status``."""
    monkeypatch.setattr(_Health, "status", status)
    argv = [sys.executable, *_healthcheck_argv()[1:]]
    port = str(health_server.server_address[1])
    result = _run(argv, env={"RELAY_PORT": port, "PATH": "/usr/bin:/bin"})
    assert (result.returncode == 0) is healthy, result.stderr


# --- compose + Caddy ----------------------------------------------------------------------


def _compose_file() -> dict[str, Any]:
    data = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert isinstance(data, dict)
    return data


def _environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(key): str(value) for key, value in env.items()}


def test_compose_file_shape() -> None:
    """Parsed as written (anchors merged): checked even where docker is missing."""
    services = _compose_file()["services"]
    assert set(services) == {*RELAYS, "postgres", "caddy"}
    for name in RELAYS:
        relay = services[name]
        assert relay["depends_on"]["postgres"]["condition"] == "service_healthy"
        env = _environment(relay)
        assert env["RELAY_DATABASE_URL"].startswith("postgresql+asyncpg://")
        assert "${POSTGRES_PASSWORD" in env["RELAY_DATABASE_URL"], "password only via .env"
        assert not (SECRETS - {"RELAY_DATABASE_URL"}) & set(env), "provider keys via env_file"
        assert relay["env_file"] == ".env"
        assert "./tokens.toml:/etc/relay/tokens.toml:ro" in relay["volumes"]
        assert relay["read_only"] is True
        assert _seconds(relay["stop_grace_period"]) > DRAIN_S
    postgres = services["postgres"]
    assert "pg_isready" in " ".join(postgres["healthcheck"]["test"])
    assert any(str(v).endswith(":/var/lib/postgresql/data") for v in postgres["volumes"])
    assert "env_file" not in postgres and "env_file" not in services["caddy"]
    assert "443:443" in services["caddy"]["ports"]
    assert _compose_file()["networks"]["db"]["internal"] is True


def _seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)", str(duration))
    assert match, duration
    value, unit = float(match[1]), match[2]
    return value / 1000 if unit == "ms" else value * 60 if unit == "m" else value


def _compose_command() -> list[str] | None:
    if shutil.which("docker") and _run(["docker", "compose", "version"]).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


@pytest.fixture
def compose_project(tmp_path: Path) -> Path:
    """deploy/ copied beside a dummy .env and tokens file, as an operator would have it."""
    deploy = tmp_path / "deploy"
    deploy.mkdir()
    for name in ("compose.yaml", "Caddyfile"):
        shutil.copy(DEPLOY / name, deploy / name)
    (deploy / "tokens.toml").write_text("")
    (tmp_path / "jobs").mkdir()
    (deploy / ".env").write_text(
        "COMPOSE_PROJECT_NAME=relay\n"
        "RELAY_DOMAIN=relay.example.com\n"
        "POSTGRES_PASSWORD=0123456789abcdef\n"
        "TOKENS_GID=1000\n"
        "RELAY_PROVIDERS=e2b\n"
        "RELAY_E2B_API_KEY=e2b_dummy\n"
    )
    return deploy


def test_compose_config(compose_project: Path) -> None:
    command = _compose_command()
    if command is None:
        pytest.skip("neither `docker compose` (the v2 plugin) nor `docker-compose` is installed")
    result = _run([*command, "-f", "compose.yaml", "config"], cwd=compose_project)
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    services = config["services"]
    assert set(services) == {*RELAYS, "postgres", "caddy"}
    for name in RELAYS:
        env = _environment(services[name])
        assert env["RELAY_DATABASE_URL"] == (
            "postgresql+asyncpg://relay:0123456789abcdef@postgres:5432/relay"
        )
        assert env["RELAY_E2B_API_KEY"] == "e2b_dummy", "the env file reaches the relays"
        assert env["RELAY_PUBLIC_URL"] == "https://relay.example.com"
        assert services[name]["image"] == "relay:local"
        assert _mount_is_read_only(services[name]["volumes"], "/etc/relay/tokens.toml")
    assert "RELAY_E2B_API_KEY" not in _environment(services["postgres"])
    assert "RELAY_E2B_API_KEY" not in _environment(services["caddy"])
    assert _environment(services["caddy"])["RELAY_DOMAIN"] == "relay.example.com"


def _mount_is_read_only(volumes: list[Any], target: str) -> bool:
    """A bind mount's read-only flag, in v1's short form or v2's long form of `config`."""
    for volume in volumes:
        if isinstance(volume, str) and volume.split(":")[1] == target:
            return volume.endswith(":ro")
        if isinstance(volume, dict) and volume.get("target") == target:
            return bool(volume.get("read_only"))
    raise AssertionError(f"nothing mounted at {target}")


def test_compose_config_refuses_a_missing_domain(compose_project: Path) -> None:
    command = _compose_command()
    if command is None:
        pytest.skip("neither `docker compose` (the v2 plugin) nor `docker-compose` is installed")
    env_file = compose_project / ".env"
    env_file.write_text(env_file.read_text().replace("RELAY_DOMAIN=relay.example.com\n", ""))
    result = _run([*command, "-f", "compose.yaml", "config"], cwd=compose_project)
    assert result.returncode != 0
    assert "RELAY_DOMAIN" in result.stderr


def test_caddyfile_text() -> None:
    text = (DEPLOY / "Caddyfile").read_text()
    assert re.search(r"^\{\$RELAY_DOMAIN\} \{", text, re.MULTILINE)
    assert re.search(r"reverse_proxy relay-1:8080 relay-2:8080", text)
    assert re.search(r"health_uri /healthz", text)


def _handlers(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        if "handler" in node:
            yield node
        for value in node.values():
            yield from _handlers(value)
    elif isinstance(node, list):
        for value in node:
            yield from _handlers(value)


def test_caddy_adapt() -> None:
    """`caddy adapt` (not `validate`, which may try to obtain certificates)."""
    caddy = shutil.which("caddy")
    if caddy is None:
        pytest.skip("caddy is not installed (Debian package `caddy`)")
    result = _run(
        [caddy, "adapt", "--config", str(DEPLOY / "Caddyfile"), "--adapter", "caddyfile"],
        env={"RELAY_DOMAIN": "relay.example.com", "PATH": "/usr/bin:/bin", "HOME": "/tmp"},
    )
    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout)
    [server] = config["apps"]["http"]["servers"].values()
    assert [route["match"][0]["host"] for route in server["routes"]] == [["relay.example.com"]]
    [proxy] = [h for h in _handlers(server) if h["handler"] == "reverse_proxy"]
    assert sorted(up["dial"] for up in proxy["upstreams"]) == ["relay-1:8080", "relay-2:8080"]
    assert proxy["health_checks"]["active"]["uri"] == "/healthz"
    assert "passive" in proxy["health_checks"]


# --- fly.toml -----------------------------------------------------------------------------


def _fly() -> dict[str, Any]:
    with (DEPLOY / "fly.toml").open("rb") as file:
        return tomllib.load(file)


def test_fly_http_service() -> None:
    fly = _fly()
    service = fly["http_service"]
    assert service["internal_port"] == 8080
    assert service["force_https"] is True
    assert service["min_machines_running"] >= 2
    assert service["auto_stop_machines"] in {"off", False}
    assert service["concurrency"]["type"] == "requests"
    assert 0 < service["concurrency"]["soft_limit"] <= service["concurrency"]["hard_limit"]
    assert [check["path"] for check in service["checks"]] == ["/healthz"]
    assert fly["checks"]["readyz"]["path"] == "/readyz"


def test_fly_stop_matches_drain() -> None:
    fly = _fly()
    assert fly["kill_signal"] == "SIGTERM"
    assert float(fly["kill_timeout"]) > DRAIN_S
    assert float(fly["env"].get("RELAY_DRAIN_S", DRAIN_S)) < float(fly["kill_timeout"])


def test_fly_secrets_are_documented_not_configured() -> None:
    fly = _fly()
    assert not SECRETS & set(fly["env"]), "a secret in [env]: use `fly secrets set`"
    comments = "\n".join(
        line for line in (DEPLOY / "fly.toml").read_text().splitlines() if line.lstrip()[:1] == "#"
    )
    for name in sorted(SECRETS):
        assert name in comments, f"{name} is not documented in fly.toml's comments"
    [tokens] = fly["files"]
    assert tokens["guest_path"] == fly["env"]["RELAY_TOKENS_FILE"]
    assert "secret_name" in tokens


# --- systemd ------------------------------------------------------------------------------

UNIT = DEPLOY / "systemd" / "relay.service"


def _unit() -> dict[str, list[str]]:
    """Active directives (duplicates kept in order); comments and section headers dropped."""
    directives: dict[str, list[str]] = {}
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;[":
            continue
        key, _, value = line.partition("=")
        directives.setdefault(key, []).append(value)
    return directives


def test_systemd_unit_hardening() -> None:
    unit = _unit()
    expected = {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "CapabilityBoundingSet": "",
        "KillMode": "mixed",
    }
    for key, value in expected.items():
        assert unit.get(key) == [value], f"{key}={unit.get(key)}"
    assert "/var/lib/relay" in unit["ReadWritePaths"][0].split()
    assert set(unit["RestrictAddressFamilies"][0].split()) <= {
        "AF_INET",
        "AF_INET6",
        "AF_UNIX",
        "AF_NETLINK",
    }
    assert unit["SystemCallFilter"][0].startswith("@system-service")
    assert re.fullmatch(r"\d+[KMG]", unit["MemoryMax"][0])
    assert unit["EnvironmentFile"] == ["/etc/relay/relay.env"]
    assert unit["User"][0] not in {"root", "0"}
    # bubblewrap (the local provider) needs user namespaces: not restricted in the active unit.
    assert "RestrictNamespaces" not in unit


def test_systemd_stop_timeout_matches_drain() -> None:
    unit = _unit()
    environment = dict(item.split("=", 1) for item in unit["Environment"])
    drain = float(environment.get("RELAY_DRAIN_S", DRAIN_S))
    assert drain == DRAIN_S
    assert _seconds(unit["TimeoutStopSec"][0]) > drain + 5
    for name in SECRETS:
        value = environment.get(name, "")
        assert "@" not in value and (name == "RELAY_DATABASE_URL" or not value), name


@pytest.fixture
def verifiable_unit(tmp_path: Path) -> Path:
    """The unit with ExecStart's binary swapped for one that exists on this machine."""
    text = re.sub(r"^ExecStart=\S+", "ExecStart=/bin/true", UNIT.read_text(), flags=re.M)
    path = tmp_path / "relay.service"
    path.write_text(text)
    return path


def test_systemd_analyze_verify(verifiable_unit: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    result = _run(["systemd-analyze", "verify", str(verifiable_unit)])
    assert result.returncode == 0, result.stderr
    assert "relay.service" not in result.stderr, result.stderr


def test_systemd_analyze_security(verifiable_unit: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    result = _run(["systemd-analyze", "security", "--offline=yes", str(verifiable_unit)])
    if "--offline" in result.stderr and result.returncode != 0:
        pytest.skip(f"systemd-analyze has no --offline (systemd < 250): {result.stderr.strip()}")
    match = re.search(r"Overall exposure level for relay\.service: (\d+\.\d+) (\w+)", result.stdout)
    assert match, result.stdout[-500:] + result.stderr
    assert float(match[1]) <= 3.0 and match[2] in {"SAFE", "OK"}, match[0]


# --- Kubernetes ---------------------------------------------------------------------------


def _manifests() -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) -> object, from every manifest in deploy/k8s but the kustomization."""
    objects: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                objects[(document["kind"], document["metadata"]["name"])] = document
    return objects


def _pod_spec() -> dict[str, Any]:
    spec: dict[str, Any] = _manifests()[("Deployment", "relay")]["spec"]["template"]["spec"]
    return spec


def _container() -> dict[str, Any]:
    [container] = _pod_spec()["containers"]
    assert isinstance(container, dict)
    return container


def _port_number(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    [number] = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return int(number)


def test_k8s_deployment_replicas_image_and_selector() -> None:
    deployment = _manifests()[("Deployment", "relay")]
    spec = deployment["spec"]
    assert spec["replicas"] == 2
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    image = _container()["image"]
    assert re.fullmatch(r"[\w.\-/:]+/relay:[\w.\-]+", image), image
    assert not image.endswith(":latest")
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_k8s_probes() -> None:
    container = _container()
    readiness, liveness = container["readinessProbe"], container["livenessProbe"]
    assert readiness["httpGet"]["path"] == "/readyz"
    assert liveness["httpGet"]["path"] == "/healthz"
    for probe in (readiness, liveness, container["startupProbe"]):
        assert _port_number(container, probe["httpGet"]["port"]) == 8080


def test_k8s_resources() -> None:
    resources = _container()["resources"]
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(resources[kind]), kind


def test_k8s_env_from_secrets_only() -> None:
    container = _container()
    manifests = _manifests()
    refs = [source["secretRef"]["name"] for source in container["envFrom"]]
    assert refs == ["relay-env"]
    secret = manifests[("Secret", "relay-env")]
    assert "RELAY_DATABASE_URL" in secret["stringData"]
    for name, value in secret["stringData"].items():
        if name in SECRETS:
            assert "REPLACE_ME" in value, f"{name} in the Secret template is not a placeholder"
    plain = {item["name"]: item for item in container.get("env", [])}
    for name in SECRETS & set(plain):
        assert "valueFrom" in plain[name], f"{name} set as a plain value"
    tokens = manifests[("Secret", "relay-tokens")]["stringData"]["tokens.toml"]
    assert "REPLACE_ME" in tokens


def test_k8s_tokens_mounted_read_only() -> None:
    container = _container()
    env = {item["name"]: item.get("value") for item in container["env"]}
    volumes = {volume["name"]: volume for volume in _pod_spec()["volumes"]}
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "tokens"]
    assert mount["readOnly"] is True
    assert volumes["tokens"]["secret"]["secretName"] == "relay-tokens"
    assert env["RELAY_TOKENS_FILE"] == f"{mount['mountPath']}/tokens.toml"


def test_k8s_security_context() -> None:
    pod, container = _pod_spec(), _container()
    assert pod["securityContext"]["runAsNonRoot"] is True
    [image_user] = [args for keyword, args in _final_stage() if keyword == "USER"]
    uid, _, gid = image_user.partition(":")
    assert pod["securityContext"]["runAsUser"] == int(uid) != 0, "the image's own uid"
    assert pod["securityContext"]["fsGroup"] == int(gid or uid)
    assert pod["automountServiceAccountToken"] is False
    context = container["securityContext"]
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"]["drop"] == ["ALL"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    [tmp] = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert "emptyDir" in volumes[tmp["name"]]


def test_k8s_grace_period_exceeds_drain() -> None:
    pod, container = _pod_spec(), _container()
    env = {item["name"]: item.get("value") for item in container["env"]}
    drain = float(env.get("RELAY_DRAIN_S", DRAIN_S))
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    pre_stop_s = float(pre_stop[-1]) if pre_stop[0] == "sleep" else 0.0
    assert pod["terminationGracePeriodSeconds"] > pre_stop_s + drain + 5


def test_k8s_service_and_pdb_select_the_pods() -> None:
    manifests = _manifests()
    labels = manifests[("Deployment", "relay")]["spec"]["template"]["metadata"]["labels"]
    service = manifests[("Service", "relay")]["spec"]
    assert service["selector"].items() <= labels.items()
    [port] = service["ports"]
    assert _port_number(_container(), port["targetPort"]) == 8080
    pdb = manifests[("PodDisruptionBudget", "relay")]["spec"]
    assert pdb["minAvailable"] == 1
    assert pdb["selector"]["matchLabels"].items() <= labels.items()


def _ports(rule: dict[str, Any]) -> set[tuple[str, int]]:
    return {(port.get("protocol", "TCP"), port["port"]) for port in rule["ports"]}


def test_k8s_network_policy() -> None:
    manifests = _manifests()
    labels = manifests[("Deployment", "relay")]["spec"]["template"]["metadata"]["labels"]
    policy = manifests[("NetworkPolicy", "relay")]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert sorted(policy["policyTypes"]) == ["Egress", "Ingress"]
    # Ingress: the relay's port only.
    assert [_ports(rule) for rule in policy["ingress"]] == [{("TCP", 8080)}]
    # Egress: every rule is limited to ports; together DNS, PostgreSQL and HTTPS, no more.
    egress = policy["egress"]
    assert all(rule.get("ports") for rule in egress), "an egress rule without ports"
    allowed = set().union(*(_ports(rule) for rule in egress))
    assert allowed == {("UDP", 53), ("TCP", 53), ("TCP", 5432), ("TCP", 443)}
    [https] = [rule for rule in egress if _ports(rule) == {("TCP", 443)}]
    metadata = ipaddress.ip_address("169.254.169.254")
    for block in (peer["ipBlock"] for peer in https["to"]):
        network = ipaddress.ip_network(block["cidr"])
        if metadata.version == network.version and metadata in network:
            excepted = [ipaddress.ip_network(cidr) for cidr in block.get("except", [])]
            assert any(metadata in net for net in excepted), "cloud metadata reachable"


def test_k8s_kustomization_lists_every_manifest_but_the_secret_template() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    present = {path.name for path in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    # The template stays out, or `kubectl apply -k` would overwrite real Secrets with it.
    assert set(kustomization["resources"]) == present - {"secret.yaml"}
    image = _container()["image"].rsplit(":", 1)[0]
    assert [entry["name"] for entry in kustomization["images"]] == [image]


def test_kubectl_kustomize() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (its offline `kustomize` would build deploy/k8s)")
    result = _run([kubectl, "kustomize", str(K8S)])
    assert result.returncode == 0, result.stderr
    objects = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    kinds = sorted(doc["kind"] for doc in objects)
    assert kinds == ["Deployment", "NetworkPolicy", "PodDisruptionBudget", "Service"]
    assert {doc["metadata"].get("namespace") for doc in objects} == {"relay"}


# --- docs -----------------------------------------------------------------------------------


def test_deploy_doc_covers_the_recipes() -> None:
    text = (ROOT / "docs" / "deploy.md").read_text()
    for needle in (
        "docker compose up -d",
        "relay tokens new",
        "/healthz",
        "curl",
        "fly deploy",
        "systemctl",
        "kubectl apply -k",
    ):
        assert needle in text, needle
    for name in sorted(SECRETS):
        assert name in text, f"{name} is not in docs/deploy.md"


# --- one container: the env file, the entrypoint, bubblewrap ------------------------------

CONTAINER_ENV = DEPLOY / "container.env"
ENTRYPOINT = ROOT / "scripts" / "container-entrypoint.sh"
IMAGE_UID = 10001


def _env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines as `docker run --env-file` reads them (no quotes, no comments)."""
    pairs = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            pairs[key.strip()] = value
    return pairs


def _image_env() -> dict[str, str]:
    """The final stage's ENV (KEY=VALUE words), as the container starts with them."""
    env = " ".join(args for keyword, args in _final_stage() if keyword == "ENV")
    return dict(word.split("=", 1) for word in env.split() if "=" in word)


def test_container_env_binds_all_addresses_with_the_image_paths_and_bwrap() -> None:
    env = _env_file(CONTAINER_ENV)
    image = _image_env()
    assert env["RELAY_HOST"] == "0.0.0.0"
    for name in ("RELAY_PORT", "RELAY_TOKENS_FILE", "RELAY_JOBS_DIR", "RELAY_DATABASE_URL"):
        assert env[name] == image[name], name
    assert env["RELAY_LOCAL_ISOLATION"] == "bwrap", "a silent fallback to no sandbox"
    known = {f"RELAY_{name.upper()}" for name in Settings.model_fields}
    assert set(env) <= known, set(env) - known
    assert not set(env) & SECRETS - {"RELAY_DATABASE_URL"}, "a secret in a file of the repo"
    documented = (ROOT / "docs" / "deploy.md").read_text()
    assert "--env-file deploy/container.env" in documented
    for flag in ("seccomp=unconfined", "apparmor=unconfined", "systempaths=unconfined"):
        assert flag in CONTAINER_ENV.read_text() and flag in documented, flag


def _entrypoint(
    env: dict[str, str],
    *argv: str,
    uid: int | None = None,
    groups: list[int] | None = None,
    script: Path = ENTRYPOINT,
    folder: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """The image's entrypoint, run by dash (the slim image's /bin/sh) with the image's ENV
    overridden by an env file, as `docker run --env-file` does (``groups``: as `--group-add`
    gives). As another ``uid`` it runs a copy in ``folder``, which that user can read: the
    clone may sit in a folder only its owner enters (`mktemp -d` makes it 0700), as the
    image's own copy never does."""
    if uid is not None and folder is not None:
        script = Path(shutil.copy(script, folder / script.name))
        script.chmod(0o755)
    command = ["dash", str(script), *argv]
    if uid is not None:
        added = f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups"
        command = ["setpriv", f"--reuid={uid}", f"--regid={uid}", added, *command]
    full = {**_image_env(), **env, "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
    return _run(command, env=full, cwd=folder)


@pytest.mark.skipif(shutil.which("dash") is None, reason="dash is not installed")
def test_entrypoint_refuses_env_example_in_one_line() -> None:
    done = _entrypoint(_env_file(ROOT / ".env.example"), "serve")
    assert done.returncode == 2
    [line] = done.stderr.splitlines()
    assert "RELAY_HOST=127.0.0.1" in line and "deploy/container.env" in line
    relative = {**_env_file(CONTAINER_ENV), "RELAY_TOKENS_FILE": "tokens.toml"}
    [line] = _entrypoint(relative, "serve").stderr.splitlines()
    assert "RELAY_TOKENS_FILE=tokens.toml" in line and "deploy/container.env" in line


@pytest.mark.skipif(shutil.which("dash") is None, reason="dash is not installed")
def test_entrypoint_names_the_fix_for_a_tokens_file_the_image_user_cannot_read(
    tmp_path: Path,
) -> None:
    # The script as a clone made with `mktemp -d` holds it: in a folder only root enters.
    private = tmp_path / "clone"
    private.mkdir(mode=0o700)
    script = Path(shutil.copy(ENTRYPOINT, private / ENTRYPOINT.name))
    # Under /tmp when root: TMPDIR may be under /root, which the image's user cannot enter.
    folder = Path(tempfile.mkdtemp(prefix="relay-image-", dir=temp_base()))
    try:
        folder.chmod(0o755)
        tokens = folder / "tokens.toml"
        env = {**_env_file(CONTAINER_ENV), "RELAY_TOKENS_FILE": str(tokens)}
        as_image = _entrypoint(env, "serve", uid=IMAGE_UID, script=script, folder=folder)
        [line] = as_image.stderr.splitlines()
        assert f"no tokens file at {tokens}" in line and ":ro" in line
        tokens.write_text("")
        tokens.chmod(0o600)  # as `make serve` writes it
        done = _entrypoint(env, "serve", uid=IMAGE_UID, script=script, folder=folder)
        assert done.returncode == 2
        [line] = done.stderr.splitlines()
        assert f"not readable by uid {IMAGE_UID}" in line and "chmod 640 tokens.toml" in line
        assert "--group-add" in line and "never 644" in line
        # The fix it names: the file's group (here one --group-add would give) may read it.
        os.chown(tokens, -1, 4242)
        tokens.chmod(0o640)
        readable = _entrypoint(
            env, "serve", "--help", uid=IMAGE_UID, groups=[4242], script=script, folder=folder
        )
        assert "not readable" not in readable.stderr, readable.stderr
        done = _entrypoint(env, "serve", "--help")
        assert done.returncode == 0 and "usage: relay serve" in done.stdout, done.stderr
        # Other commands (`tokens new` into a mounted folder) are not checked.
        assert _entrypoint(_env_file(ROOT / ".env.example"), "--version").returncode == 0
    finally:
        shutil.rmtree(folder)


@pytest.mark.slow  # starts the relay in a subprocess: seconds
def test_local_isolation_bwrap_refuses_to_start_in_one_line_without_bubblewrap(
    tmp_path: Path,
) -> None:
    env = {
        # The interpreter's folder only: no bwrap on this PATH, as in an image without it.
        "PATH": str(Path(sys.executable).parent),
        "HOME": str(tmp_path),
        "RELAY_PROVIDERS": "local",
        "RELAY_LOCAL_ISOLATION": "bwrap",
        "RELAY_TOKENS_FILE": str(tmp_path / "tokens.toml"),
        "RELAY_DATABASE_URL": f"sqlite:///{tmp_path / 'relay.db'}",
        "RELAY_LOCAL_ROOT": str(tmp_path / "sandboxes"),
        "RELAY_JOBS_DIR": str(ROOT / "jobs"),
        # Not the default 8080: another relay on this machine may hold it.
        "RELAY_PORT": str(free_port()),
    }
    made = _run([sys.executable, "-m", "relay", "tokens", "new", "ci"], env=env, cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    done = _run([sys.executable, "-m", "relay", "serve"], env=env, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.splitlines()
    assert line == (
        "error: RELAY_LOCAL_ISOLATION=bwrap: bubblewrap is not installed: "
        "apt-get install bubblewrap"
    )


@pytest.mark.parametrize(
    ("error", "flag"),
    [
        # bubblewrap 0.8's own words under Docker's defaults, one missing allowance each.
        ("bwrap: Can't mount proc on /newroot/proc: Operation not permitted", "systempaths="),
        (
            "bwrap: No permissions to creating new namespace, likely because the kernel does "
            "not allow non-privileged user namespaces.",
            "seccomp=unconfined",
        ),
        ("bwrap: setting up uid map: Permission denied", "seccomp=unconfined"),
        ("bwrap: Failed to make / slave: Permission denied", "apparmor=unconfined"),
    ],
)
def test_a_failing_bubblewrap_names_the_flag_the_container_lacks(error: str, flag: str) -> None:
    from relay.providers.local.invocation import bwrap_fix

    assert flag in bwrap_fix(error)


def test_readiness_comments_say_what_readyz_checks() -> None:
    for path in (K8S / "deployment.yaml", DEPLOY / "fly.toml"):
        text = path.read_text()
        assert "providers ok" not in text, path
        [comment] = re.findall(r"^\s*# (?:Ready for traffic|Readiness).*(?:\n\s*#.*)*", text, re.M)
        words = " ".join(re.sub(r"^\s*#", "", line) for line in comment.splitlines())
        words = " ".join(words.lower().split())
        for word in ("store", "writes", "token file", "draining", "no cloud provider"):
            assert word in words, (path, word)
