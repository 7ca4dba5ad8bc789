"""``python -m relay`` is the ``relay`` command."""

from __future__ import annotations

import sys

from relay.cli import main

sys.exit(main())
