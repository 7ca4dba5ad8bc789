"""Runs: what a run is and how it goes, from a request to its final row.

The API's models, the one view that turns a stored run into the API's ``Run`` (view.py), the
job catalog, planning (request -> plan), callback URL safety, costs, the in-process event
bus, the run service (submit, wait, cancel, and the run's task) and the reaper. It may
import relay.providers, relay.store and the shared auth, settings, errors and logs; it knows
nothing of HTTP or webhooks.
"""
