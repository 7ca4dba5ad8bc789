"""The contract on E2B: the real ``e2b`` SDK against the protocol fake (testing/rigs/e2b.py)."""

from tests.contract.artifact_suite import ArtifactContract
from tests.contract.fault_suite import FaultContract
from tests.contract.suite import ProviderContract


class TestE2B(ProviderContract, ArtifactContract, FaultContract, rig="e2b"):
    """The contract on E2B."""
