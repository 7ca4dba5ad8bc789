"""``relay jobs``: list the job catalog, which validates it (a bad manifest: one line)."""

from __future__ import annotations

import argparse
import json
import sys

from relay.cli.configuration import load_settings
from relay.runs.catalog import Catalog


def cmd_jobs(args: argparse.Namespace) -> int:
    settings = load_settings()
    catalog = Catalog.load(settings.jobs_dir)
    if args.json:
        listed = [
            {
                "name": job.name,
                "description": job.description,
                "timeout_s": job.timeout_s,
                "egress": list(job.egress),
                "params": {
                    name: {"type": param.type, "required": param.required}
                    for name, param in job.params.items()
                },
            }
            for job in catalog.jobs.values()
        ]
        print(json.dumps(listed, indent=2))
        return 0
    for job in catalog.jobs.values():
        params = " ".join(
            f"{p.name}:{p.type}{'' if p.required else '?'}" for p in job.params.values()
        )
        print(f"{job.name:20} {job.timeout_s:>6.0f}s egress={list(job.egress)} {params}")
    if not catalog.jobs:
        print(f"no jobs in {settings.jobs_dir}: `relay init` writes the examples", file=sys.stderr)
        return 0
    print(f"{len(catalog.jobs)} job(s) valid in {settings.jobs_dir}", file=sys.stderr)
    return 0
