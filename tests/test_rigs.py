"""Every provider the relay registers is in every place a provider must be: a rig
(``testing/rigs``), a contract class (``tests/contract``), a line in the "No provider imports
another" import contract, and its variables in ``.env.example``. Adding a provider is its
module, its registry line, its rig and its contract line; this says which one is missing."""

from __future__ import annotations

import importlib
import re
import tomllib
from collections.abc import Iterator

import pytest

from relay.providers.registry import PROVIDERS, provider_variables
from relay.settings import Settings
from testing.rigs import RIGS
from testing.rigs.rig import FAULT_VARIANTS
from tests.conftest import REPO
from tests.contract.fault_suite import FaultContract
from tests.contract.suite import ProviderContract

INDEPENDENCE = "No provider imports another"


def contract_classes() -> Iterator[type[ProviderContract]]:
    """Every class of ``tests/contract/test_*.py`` that joins the suites with a rig."""
    for path in sorted((REPO / "tests" / "contract").glob("test_*.py")):
        module = importlib.import_module(f"tests.contract.{path.stem}")
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, ProviderContract)
                and value.__module__ == module.__name__
            ):
                yield value


def independent_modules() -> list[str]:
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    [independence] = [c for c in contracts["contracts"] if c["name"] == INDEPENDENCE]
    modules: list[str] = independence["modules"]
    return modules


def variables_of(name: str) -> set[str]:
    """The ``RELAY_`` variables a provider reads: its settings model's, and the relay's own
    settings under its name (local's are there)."""
    own = provider_variables(name)
    assert own is not None, f"{name}'s SDK is not installed here (the dev extra has them all)"
    shared = {f"RELAY_{field.upper()}" for field in Settings.model_fields}
    return own | {v for v in shared if v.startswith(f"RELAY_{name.upper()}_")}


def missing_places(name: str) -> list[str]:
    """What a registered provider lacks, in words a newcomer can act on."""
    missing = []
    rig = RIGS.get(name)
    if rig is None or rig.name != name:
        missing.append(f"a rig in testing/rigs (RIGS[{name!r}])")
    elif rig.faulty and not set(FAULT_VARIANTS) <= set(rig.variants):
        missing.append(f"the fault suite's variants {FAULT_VARIANTS} in its rig")
    joined = [c for c in contract_classes() if getattr(c, "rig", None) == name and not c.variant]
    if not joined:
        missing.append(f"a contract class: tests/contract/test_{name}.py, rig={name!r}")
    elif rig is not None and rig.faulty and not all(issubclass(c, FaultContract) for c in joined):
        missing.append("FaultContract in its contract class (its rig has fault switches)")
    # The module (or package) under relay/providers/ that its registry entry loads.
    package = ".".join(PROVIDERS[name].target.split(":")[0].split(".")[:3])
    if package not in independent_modules():
        missing.append(f"{package!r} in pyproject.toml's {INDEPENDENCE!r} contract")
    example = (REPO / ".env.example").read_text()
    undocumented = sorted(
        v for v in variables_of(name) if not re.search(rf"^#? ?{v}=", example, re.M)
    )
    if undocumented:
        missing.append(f"{', '.join(undocumented)} in .env.example")
    return missing


@pytest.mark.parametrize("name", list(PROVIDERS))
def test_a_registered_provider_has_its_rig_contract_class_import_line_and_variables(
    name: str,
) -> None:
    missing = missing_places(name)
    assert missing == [], f"provider {name!r} lacks: {'; '.join(missing)}"


def test_every_rig_and_contract_class_names_a_registered_provider() -> None:
    assert set(RIGS) <= set(PROVIDERS), set(RIGS) - set(PROVIDERS)
    for joined in contract_classes():
        assert getattr(joined, "rig", None) in RIGS, f"{joined.__name__} names no rig"
        assert joined.variant is None or joined.variant in RIGS[joined.rig].variants
