"""What a request may set for a job, as the plan decides it: a field the job's ``allow``
does not list is refused when set to a value, and taken when sent empty or null (the plan
looks at each only when the request set one of them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from relay.auth import Principal
from relay.errors import Forbidden
from relay.providers.memory import MemoryProvider
from relay.runs.catalog import Catalog
from relay.runs.models import RunRequest
from relay.runs.planning import Planner
from relay.settings import Settings


@pytest.fixture
def planner(tmp_path: Path) -> Planner:
    for name, allow in (("fixed", ""), ("open", 'allow = ["image", "env", "artifacts"]\n')):
        (tmp_path / name).mkdir()
        (tmp_path / name / "job.toml").write_text(
            f'description = "x"\ncommand = ["true"]\nprovider = "memory"\n'
            f'artifacts = ["out.txt"]\n{allow}'
        )
    settings = Settings(_env_file=None, providers=["memory"])  # type: ignore[call-arg]
    return Planner(settings, Catalog.load(tmp_path), {"memory": MemoryProvider(settings)})


@pytest.mark.parametrize(
    ("body", "refused"),
    [
        ({}, None),
        ({"image": None, "env": {}, "files": {}, "artifacts": [], "egress": None}, None),
        ({"image": "python:3.12"}, "image"),
        ({"env": {"A": "b"}, "timeout_s": 5}, "env"),
        ({"artifacts": ["more.txt"]}, "artifacts"),
    ],
)
def test_a_job_refuses_what_its_allow_does_not_list_and_takes_it_sent_empty(
    planner: Planner, body: dict[str, object], refused: str | None
) -> None:
    request = RunRequest.model_validate({"job": "fixed", **body})
    if refused is None:
        plan = planner.plan(Principal("t"), request, "run_1")
        assert plan.artifacts == ("out.txt",) and plan.env == {} and plan.argv == ["true"]
    else:
        with pytest.raises(Forbidden, match=f"does not let a request set `{refused}`"):
            planner.plan(Principal("t"), request, "run_1")


def test_a_job_that_allows_them_takes_a_requests_image_env_and_artifacts(
    planner: Planner,
) -> None:
    request = RunRequest.model_validate(
        {"job": "open", "image": "img", "env": {"A": "b"}, "artifacts": ["out.txt", "b.txt"]}
    )
    plan = planner.plan(Principal("t"), request, "run_1")
    assert (plan.spec.image, plan.env, plan.artifacts) == ("img", {"A": "b"}, ("out.txt", "b.txt"))
    again = planner.plan(Principal("t"), RunRequest.model_validate({"job": "open"}), "run_2")
    assert (again.spec.image, again.env, again.artifacts) == (None, {}, ("out.txt",))
