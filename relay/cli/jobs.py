"""``relay jobs``: list the job catalog, which validates it."""

from __future__ import annotations

import argparse
import sys

from relay.cli.configuration import load_settings
from relay.runs.catalog import Catalog


def cmd_jobs(args: argparse.Namespace) -> int:
    settings = load_settings()
    catalog = Catalog.load(settings.jobs_dir)
    for job in catalog.jobs.values():
        params = " ".join(
            f"{p.name}:{p.type}{'' if p.required else '?'}" for p in job.params.values()
        )
        print(f"{job.name:20} {job.timeout_s:>6.0f}s egress={list(job.egress)} {params}")
    print(f"{len(catalog.jobs)} job(s) valid in {settings.jobs_dir}", file=sys.stderr)
    return 0
