"""What a run costs: provider rates per vCPU-second and GiB-second, worst case and actual.

Each provider class carries its published list price (``rate``, see the README's reference
tables); ``RELAY_COST_RATES`` overrides any of them, e.g.
``{"e2b": {"vcpu_s": 0.000014, "gib_s": 0.0000045}}``. The local provider costs nothing.
A run's worst case (its timeout at its size) is reserved against the token's daily budget
before it starts; its actual cost (measured sandbox seconds at its size) is recorded after.
"""

from __future__ import annotations

from collections.abc import Mapping

from relay.providers.contract import Provider, Rate

FREE = Rate(0.0, 0.0)


class CostModel:
    """Rates for every provider, with the operator's overrides applied."""

    def __init__(
        self,
        providers: Mapping[str, Provider],
        overrides: Mapping[str, Mapping[str, float]] | None = None,
    ) -> None:
        self.rates = {name: provider.rate for name, provider in providers.items()}
        for provider, values in (overrides or {}).items():
            base = self.rates.get(provider, FREE)
            self.rates[provider] = Rate(
                float(values.get("vcpu_s", base.vcpu_s)), float(values.get("gib_s", base.gib_s))
            )

    def cost(self, provider: str, cpu: float, memory_mb: int, seconds: float) -> float:
        """USD for ``seconds`` of a sandbox of this size (0 for an unknown provider)."""
        rate = self.rates.get(provider, FREE)
        per_second = cpu * rate.vcpu_s + (memory_mb / 1024) * rate.gib_s
        return round(max(0.0, seconds) * per_second, 9)
