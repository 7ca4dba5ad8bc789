"""The contract on Daytona: the real ``daytona`` SDK against the protocol fake (testing/rigs/daytona.py)."""

from tests.contract.fault_suite import FaultContract
from tests.contract.suite import ProviderContract


class TestDaytona(ProviderContract, FaultContract, rig="daytona"):
    """The contract on Daytona."""
