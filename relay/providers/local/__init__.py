"""The local provider: a sandbox on the relay's own machine, in bubblewrap or (trusted jobs
only) a process group with rlimits.

Here: provider.py, the provider and its sandbox; spawn.py, which starts a sandbox's process
without forking the relay; cgroups.py, a sandbox's memory, process and CPU limits;
private_network.py, a sandbox's own network for its egress. It imports only
relay.providers.base and the shared settings and errors.
"""
