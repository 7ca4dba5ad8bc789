"""What a provider supplies to run the shared contract suite.

Each provider has a module ``tests/contract/harness_<name>.py`` exporting
``open_harness(tmp_path) -> AbstractAsyncContextManager[Harness]``. The suite in
``test_contract.py`` runs against every harness module that exists.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from relay.providers.base import Provider


@dataclass
class Harness:
    """A provider under test plus the ground truth about its sandboxes."""

    provider: Provider
    alive: Callable[[], Awaitable[set[str]]]
    """Ids of sandboxes still alive, from the ledger of a fake or the process table."""
    lifetime_of: Callable[[str], Awaitable[float | None]]
    """The provider-side lifetime (seconds) a sandbox was created with."""
    tags_of: Callable[[str], Awaitable[dict[str, str]]]
    """The tags (metadata, labels) a sandbox was created with."""
    image: str | None = None
