"""The contract on Cloudflare: the provider against the fake job Worker
(testing/rigs/cloudflare.py)."""

from tests.contract.artifact_suite import ArtifactContract
from tests.contract.fault_suite import FaultContract
from tests.contract.suite import ProviderContract


class TestCloudflare(ProviderContract, ArtifactContract, FaultContract, rig="cloudflare"):
    """The contract on Cloudflare."""
