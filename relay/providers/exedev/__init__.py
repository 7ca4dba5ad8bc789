"""The ``exedev`` provider: each job in a fresh exe.dev VM, through exe.dev's own Python SDK
(``exedev`` 0.4.0: every call a ``POST {base}/exec`` whose body is a lobby command line).

exe.dev gives a VM no lifetime of its own and a command no deadline, and has no stdin; the
SDK waits ten minutes for any answer and shields a cancelled ``new()``. So the relay:

* names every VM before it asks for it (``<cluster>-<run>-<hash>``) and tags it (cluster,
  run, lifetime, creation time), bounds every read itself (stream.py), and after a create that
  failed, timed out or was cancelled deletes the VM by that name (names.py);
* runs the job detached on the VM, under ``timeout -s KILL``, with its stdin and variables
  from files, and follows its output files over ``ssh`` streams, again from the bytes already
  received when one breaks: exact bytes, live (scripts.py, sandbox.py);
* always deletes the VM (``rm``) and lists it until it is gone; its reaper deletes by tag what a
  crashed relay left (provider.py). ``GET /v1/providers`` says ``hard_lifetime: false``.

docs/providers/exedev.md has the whole mapping. The modules: provider.py (settings, error table,
rate, create, delete, list), sandbox.py (files, a command), scripts.py (the shell scripts run on
the VM, the files' archive), stream.py (the transport that bounds reads, the NDJSON reader),
names.py (names and tags).
"""
