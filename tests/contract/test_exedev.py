"""The contract on exe.dev: the real SDK against the protocol fake (testing/rigs/exedev.py)."""

from tests.contract.fault_suite import FaultContract
from tests.contract.suite import ProviderContract


class TestExedev(ProviderContract, FaultContract, rig="exedev"):
    """The contract on exe.dev."""
