"""What a run costs: provider rates per vCPU-second and GiB-second, worst case and actual.

Defaults are the providers' published list prices (the reference tables in the README);
``RELAY_COST_RATES`` overrides any of them, e.g.
``{"e2b": {"vcpu_s": 0.000014, "gib_s": 0.0000045}}``. The local provider costs nothing.
A run's worst case (its timeout at its size) is reserved against the token's daily budget
before it starts; its actual cost (measured sandbox seconds at its size) is recorded after.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Rate:
    """USD per second for one vCPU, and for one GiB of memory."""

    vcpu_s: float
    gib_s: float


DEFAULT_RATES: dict[str, Rate] = {
    "local": Rate(0.0, 0.0),
    "modal": Rate(0.00003942, 0.00000667),
    "e2b": Rate(0.000014, 0.0000045),
    # Vercel bills active CPU ($0.128 per vCPU-hour) and provisioned memory ($0.0106 per
    # GB-hour); charging every second as active CPU gives an upper bound.
    "vercel": Rate(0.128 / 3600, 0.0106 / 3600),
}


class CostModel:
    """Rates for every provider, with the operator's overrides applied."""

    def __init__(self, overrides: Mapping[str, Mapping[str, float]] | None = None) -> None:
        self.rates = dict(DEFAULT_RATES)
        for provider, values in (overrides or {}).items():
            base = self.rates.get(provider, Rate(0.0, 0.0))
            self.rates[provider] = Rate(
                float(values.get("vcpu_s", base.vcpu_s)), float(values.get("gib_s", base.gib_s))
            )

    def cost(self, provider: str, cpu: float, memory_mb: int, seconds: float) -> float:
        """USD for ``seconds`` of a sandbox of this size (0 for an unknown provider)."""
        rate = self.rates.get(provider, Rate(0.0, 0.0))
        per_second = cpu * rate.vcpu_s + (memory_mb / 1024) * rate.gib_s
        return round(max(0.0, seconds) * per_second, 9)
