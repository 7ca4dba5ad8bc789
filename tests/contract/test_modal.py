"""The contract on Modal: the real ``modal`` client against the fake Modal (testing/rigs/modal.py)."""

from tests.contract.artifact_suite import ArtifactContract
from tests.contract.fault_suite import FaultContract
from tests.contract.suite import ProviderContract


class TestModal(ProviderContract, ArtifactContract, FaultContract, rig="modal"):
    """The contract on Modal."""
