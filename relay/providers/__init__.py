"""Sandbox providers behind one contract (base.py): each turns a SandboxSpec into a running
sandbox, and always back into nothing.

registry.py builds an enabled provider by name (a cloud SDK is imported only then); e2b.py,
modal.py and vercel.py drive their SDKs; local/ runs sandboxes on this machine; probe.py
times one sandbox for ``relay probe``. A provider imports only the base and the shared
settings and errors: it knows nothing of HTTP, tokens, runs or the store, and no provider
imports another.
"""
