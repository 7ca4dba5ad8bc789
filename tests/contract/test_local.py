"""The contract on the local provider: ground truth from /proc and its folders
(testing/rigs/local.py)."""

from tests.contract.artifact_suite import ArtifactContract
from tests.contract.suite import ProviderContract


class TestLocal(ProviderContract, ArtifactContract, rig="local"):
    """The contract on local."""
