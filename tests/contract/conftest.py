"""The contract suites (``suite.py``, ``fault_suite.py``) are joined per provider by one test
class in ``test_<name>.py``; adding a provider is its module, its registry entry, and that."""
