"""The contract on exe.dev: the real SDK against the protocol fake (testing/rigs/exedev.py)."""

from tests.contract.artifact_suite import ArtifactContract
from tests.contract.fault_suite import FaultContract
from tests.contract.suite import ProviderContract


class TestExedev(ProviderContract, ArtifactContract, FaultContract, rig="exedev"):
    """The contract on exe.dev."""
