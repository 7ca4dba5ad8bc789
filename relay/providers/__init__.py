"""Sandbox providers behind one contract (contract.py): each turns a SandboxSpec into a
running sandbox, and always back into nothing, through the lifecycle written once for all of
them (lifecycle.py: the base classes a provider subclasses).

registry.py builds an enabled provider by name (a cloud SDK is imported only then); e2b.py,
modal.py, vercel.py, daytona.py, sprites.py and exedev/ drive their SDKs; memory.py is the shipped
fake; local/ runs sandboxes on this machine; probe.py times one sandbox for ``relay probe``.
A provider imports only the contract, the lifecycle and the shared ground (settings, errors,
cancellation): it knows nothing of HTTP, tokens, runs or the store, and no provider imports
another.
"""
