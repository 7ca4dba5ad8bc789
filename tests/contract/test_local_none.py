"""The local provider without bubblewrap (a process group): same contract, weaker walls."""

from tests.contract.suite import ProviderContract


class TestLocalNone(ProviderContract, rig="local", variant="none"):
    """The contract on local without bubblewrap."""
