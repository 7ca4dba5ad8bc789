"""The README, .env.example and the OpenAPI document stay true to the code."""

from __future__ import annotations

import re

from relay.errors import ERROR_CLASSES
from relay.http.openapi import document
from relay.http.routes import routes
from relay.settings import Settings
from tests.conftest import REPO

CLIENT_VARIABLES = {"RELAY_URL", "RELAY_TOKEN"}
"""Read by `relay run` and relay/client.py on the caller's side, not by the server."""


def setting_names() -> set[str]:
    return {f"RELAY_{name.upper()}" for name in Settings.model_fields}


def test_every_setting_is_in_env_example_and_readme() -> None:
    example = (REPO / ".env.example").read_text()
    readme = (REPO / "README.md").read_text()
    for name in setting_names():
        assert re.search(rf"^#? ?{name}=", example, re.M), f"{name} missing from .env.example"
        assert name in readme, f"{name} missing from README.md"
    documented = set(re.findall(r"RELAY_[A-Z0-9_]+(?==)", example))
    assert documented <= setting_names() | CLIENT_VARIABLES, documented - setting_names()


def test_every_variable_the_code_reads_is_documented() -> None:
    example = (REPO / ".env.example").read_text()
    named = set()
    for path in (REPO / "relay").rglob("*.py"):
        named |= set(re.findall(r"\bRELAY_[A-Z][A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    missing = sorted(n for n in named - {"RELAY_"} if not re.search(rf"^#? ?{n}=", example, re.M))
    assert not missing, f"named in relay/ but not in .env.example: {missing}"


def test_readme_starts_with_the_two_commands() -> None:
    head = (REPO / "README.md").read_text().split("\n## ")[0]
    assert "make serve" in head and "make test" in head


def test_openapi_covers_every_route_and_error_code() -> None:
    doc = document()
    assert doc["openapi"].startswith("3.1")
    for route in routes:
        path = route.path
        for method in route.methods or ():
            if method == "HEAD":
                continue
            assert method.lower() in doc["paths"][path], (method, path)
    described = " ".join(
        answer["description"]
        for path in doc["paths"].values()
        for operation in path.values()
        for answer in operation["responses"].values()
    )
    for cls in ERROR_CLASSES:
        if cls.status >= 400 and cls.code != "internal":
            assert cls.code in described, cls.code
