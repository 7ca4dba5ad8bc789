"""Provider names → classes, loaded only when enabled by ``RELAY_PROVIDERS``.

A cloud SDK is imported only if its provider is enabled, so a relay that uses only the
local provider installs and starts without any of them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from pydantic import ValidationError

from relay import logs
from relay.errors import ConfigError
from relay.providers.contract import Provider
from relay.settings import Settings


@dataclass(frozen=True)
class Entry:
    target: str
    extra: str | None


PROVIDERS: dict[str, Entry] = {
    "local": Entry("relay.providers.local.provider:LocalProvider", None),
    "e2b": Entry("relay.providers.e2b:E2BProvider", "e2b"),
    "modal": Entry("relay.providers.modal:ModalProvider", "modal"),
    "vercel": Entry("relay.providers.vercel:VercelProvider", "vercel"),
    "sprites": Entry("relay.providers.sprites:SpritesProvider", "sprites"),
    "daytona": Entry("relay.providers.daytona:DaytonaProvider", "daytona"),
    "exedev": Entry("relay.providers.exedev.provider:ExedevProvider", "exedev"),
    # No SDK: the relay's own job Worker (deploy/cloudflare), over httpx.
    "cloudflare": Entry("relay.providers.cloudflare:CloudflareProvider", None),
    # In-memory, for tests and benchmarks (like httpx's MockTransport); never a default.
    "memory": Entry("relay.providers.memory:MemoryProvider", None),
}


def provider_class(name: str) -> type[Provider]:
    """The class of a known provider, importing its module (and so its SDK)."""
    module_name, class_name = PROVIDERS[name].target.split(":")
    provider: type[Provider] = getattr(importlib.import_module(module_name), class_name)
    return provider


def provider_variables(name: str) -> set[str] | None:
    """The ``RELAY_<NAME>_*`` variables a provider reads (its settings model's fields), or
    ``None`` when its SDK is not installed here, so there is nothing to check them against."""
    try:
        model = provider_class(name).settings_model
    except ImportError:
        return None
    if model is None:
        return set()
    prefix = str(model.model_config.get("env_prefix", ""))
    return {f"{prefix}{field.upper()}" for field in model.model_fields}


def load_provider(name: str, settings: Settings, *, for_reaper: bool = False) -> Provider:
    """Build one provider, or a :class:`ConfigError` that says what to install or set;
    ``for_reaper``: as ``relay reap`` needs it (``SandboxProvider.for_reaper``)."""
    entry = PROVIDERS.get(name)
    if entry is None:
        raise ConfigError(f"RELAY_PROVIDERS: unknown provider {name!r}; known: {sorted(PROVIDERS)}")
    module_name, class_name = entry.target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        # The distribution is sandbox-relay: "relay" on the package index is someone else's.
        extra = f"[{entry.extra}]" if entry.extra else ""
        hint = f"pip install 'sandbox-relay{extra}'"
        raise ConfigError(f"provider {name!r} needs its SDK: {hint}") from exc
    try:
        built = getattr(module, class_name)
        provider: Provider = built.for_reaper(settings) if for_reaper else built(settings)
    except ValidationError as exc:
        # Field and reason only: the input may be a key.
        problems = "; ".join(
            f"RELAY_{name.upper()}_{'_'.join(map(str, error['loc'])).upper()}: {error['msg']}"
            for error in exc.errors()
        )
        raise ConfigError(f"provider {name!r}: {problems}") from None
    if provider.settings_model is not None:
        # Its keys, like the relay's own secrets, read [redacted] in any log line.
        logs.redact_settings(settings.section(provider.settings_model))
    return provider


def load_providers(settings: Settings, *, for_reaper: bool = False) -> dict[str, Provider]:
    return {
        name: load_provider(name, settings, for_reaper=for_reaper)
        for name in dict.fromkeys(settings.providers)
    }
