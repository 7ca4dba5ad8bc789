"""The local provider without bubblewrap (a process group): same contract, weaker walls."""

from tests.contract.artifact_suite import ArtifactContract
from tests.contract.suite import ProviderContract


class TestLocalNone(ProviderContract, ArtifactContract, rig="local", variant="none"):
    """The contract on local without bubblewrap."""
