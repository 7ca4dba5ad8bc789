"""The relay's test kit, shared by the tests (``tests/``) and the benchmarks (``bench/``).

What both drive the relay with: protocol-level fakes of the providers' servers (``fakes/``),
one rig per provider and the registry of them (``rigs/``), a real relay process
(``relay_server.py``), a throwaway PostgreSQL (``postgres.py``), run rows as the store keeps
them (``rows.py``), settings under a temp folder (``settings.py``), numbers of the shared host no other run
uses (``host.py``), and the seeded chaos
schedules (``chaos.py``, ``sprites_faults.py``, ``exedev_faults.py``). It imports the relay and never the tests or
the benchmarks (an import contract in ``pyproject.toml``); the wheel ships ``relay/`` only.
"""
