"""The contract on Daytona: the real ``daytona`` SDK against the protocol fake (testing/rigs/daytona.py)."""

from tests.contract.artifact_suite import ArtifactContract
from tests.contract.fault_suite import FaultContract
from tests.contract.suite import ProviderContract


class TestDaytona(ProviderContract, ArtifactContract, FaultContract, rig="daytona"):
    """The contract on Daytona."""
