"""The contract on Vercel: the real SDK against the protocol fake (testing/rigs/vercel.py)."""

from tests.contract.artifact_suite import ArtifactContract
from tests.contract.fault_suite import FaultContract
from tests.contract.suite import ProviderContract


class TestVercel(ProviderContract, ArtifactContract, FaultContract, rig="vercel"):
    """The contract on Vercel."""
