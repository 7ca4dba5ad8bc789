"""The embedded ``local`` provider: a sandbox on the relay's own machine.

With bubblewrap (``RELAY_LOCAL_ISOLATION=bwrap``, or ``auto`` when ``bwrap`` works):
a read-only view of the system (``/usr`` and a few harmless ``/etc`` files, never the
relay's own folder, token file or ``.env``; its own accounts, ``/etc/hosts``, host name and
memory total), new PID, user, IPC, UTS and network namespaces (the network is shared only
for ``egress = ["*"]``), no capabilities, a host uid of its own when the relay is root
(uids.py), and the ties of invocation.py and deathwatch.py: if the relay dies, even while it
creates them, its sandboxes die with it, and when the command ends everything it spawned
ends too.

Nothing of a request reaches the host:

* every process the relay starts on the host (``prlimit``, ``setpriv``, ``sh``, ``timeout``,
  ``bwrap``) gets a fixed environment of the relay's making (``invocation.HOST_ENV`` and the
  sandbox's marker); the job's variables enter the
  sandbox only, through ``--clearenv`` and ``--setenv``;
* bwrap reads its options from a memfd (``--args FD``), so the sandbox's
  ``/proc/1/cmdline`` shows ``bwrap --args N …`` and never a host path;
* no host folder is bound into the sandbox: ``/workspace``, ``/tmp`` and ``/dev/shm`` are
  tmpfs mounts capped at the run's disk size (writes past it fail with ``ENOSPC``), ``/``
  is read-only, and uploaded files (kept in memory by ``LocalSandbox.upload``) are
  copied in from memfds when the command starts. So **each exec starts from the uploaded
  files** (the relay runs one command per sandbox), and nothing a job writes lands on the
  host's disk. A sandbox's host folder holds only its ``tags.json`` (for the reaper) and a
  ``lock`` the relay keeps ``flock``-ed while the sandbox lives.

Each sandbox gets a cgroup (cgroups.py) with a memory limit (the
size's memory plus its disk, since the disk is RAM; no swap), a process limit and a CPU
quota. bwrap's child waits (``--block-fd``) until the relay has read its pid
(``--info-fd``), moved it into the group and run every other setup step
(``LocalProvider.setup_steps``); only then does the job start. When the kernel
killed a process of the job for memory, the run ends ``failed`` with ``out_of_memory``.
Where cgroups cannot be used, the relay says so once at startup and falls back to
``RLIMIT_NPROC``, ``RLIMIT_AS`` and the size-capped tmpfs mounts.

Without bubblewrap (``none``): a process group with rlimits, marked with ``SANDBOX_ID`` so a
``setsid`` child is still found and killed, in host folders under the sandbox root. That
mode is **no security boundary** and cannot keep a job off the network; ``auto`` refuses
to run a no-network job in it, while an explicit ``none`` is the operator's choice.

The modules: provider.py, the provider (isolation and limits found at startup, the egress
check, a sandbox's life and terminate, the setup steps); sandbox.py, a sandbox (uploads,
exec, the release of bwrap's child after the setup steps, the output pumps); invocation.py,
the host command that starts a job (bubblewrap's options, rlimits, memfds, the setpriv
wrapper and the tie to the relay); deathwatch.py, the process that outlives a relay killed
outright to end the sandboxes it was releasing; root.py, the sandbox root and each
sandbox's folder, lock and marked processes; spawn.py, which starts a sandbox's process
without forking the relay; cgroups.py, a sandbox's memory, process and CPU limits;
private_network.py, a sandbox's own network for its egress; uids.py, the host uid each
sandbox of a root relay runs as; file_table.py, the sandboxes' share of the host's
open-file table. They import only the provider contract and lifecycle
(relay.providers.contract, relay.providers.lifecycle), the cancellation tools and the
shared settings and errors.
"""
