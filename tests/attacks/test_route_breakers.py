"""A tenant attacks the routes: nothing a request of its own gets wrong opens a provider's
breaker for everyone (relay/runs/breakers.py: "never a request's own fault").

The first provider is the real E2B SDK against its protocol fake (a template whose name
starts with ``missing`` is answered 404, as E2B's API answers a template it does not
have); the second the memory provider. Real SQLite, the real run service.
"""

from __future__ import annotations

from pathlib import Path

from relay.runs.models import RunRequest
from tests.runs.test_route import PRINCIPAL, routed


async def test_a_requests_own_unknown_image_never_opens_the_providers_breaker(
    tmp_path: Path,
) -> None:
    async with routed(tmp_path, breaker_failures=2) as routing:
        service = routing.service
        for _ in range(3):
            request = RunRequest(command=["echo", "hi"], image="missing-mine", provider="auto")
            submitted, _ = await service.submit(PRINCIPAL, request, None)
            await service.wait(submitted.id, 30)
        assert routing.e2b_creates == 3  # each tried e2b: its breaker never skipped it
        assert service.breakers.state("e2b") == "closed"
        # Another tenant's run still goes to the first provider of the route.
        run = await routing.run()
        assert run.provider == "e2b", run.error_message
