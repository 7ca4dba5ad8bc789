"""Protocol-level fakes of the providers' servers, each answering as its provider documents
(its docstring names the document and the SDK version); the tests of their documented
shapes are in ``tests/fakes/``."""
