"""The contract suites (``suite.py``, ``fault_suite.py``) are joined per provider by one test
class in ``test_<name>.py`` naming its rig (``testing/rigs``); ``tests/test_rigs.py`` fails
while a registered provider lacks one."""
