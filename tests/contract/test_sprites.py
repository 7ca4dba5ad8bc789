"""The contract on Sprites: the real SDK against the protocol fake (testing/rigs/sprites.py)."""

from tests.contract.artifact_suite import ArtifactContract
from tests.contract.fault_suite import FaultContract
from tests.contract.suite import ProviderContract


class TestSprites(ProviderContract, ArtifactContract, FaultContract, rig="sprites"):
    """The contract on Fly.io Sprites."""
