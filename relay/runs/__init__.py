"""Runs: what a run is and how it goes, from a request to its final row.

The API's models, the one view that turns a stored run (relay/store/records.py) into the
API's ``Run`` (view.py), the job catalog, planning (request -> plan), callback URL safety,
costs, the limits policy (limits.py: what a refused run is told), the in-process event
bus, the run service (service.py: submit, get, list, wait, cancel), the runs in flight and
their final write (runner.py), the steps of one run (run_task.py), the doors a run opens
its sandbox through (sources.py: a provider, or it behind its warm pools, pools.py) and the
reaper. It may import relay.providers, relay.store and the shared auth, settings, errors,
logs, run states and cancellation tools; it knows nothing of HTTP, webhooks or the runtime.
"""
