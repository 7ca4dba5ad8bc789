"""Frozen values made without their ``__init__`` (relay/store/records.py ``maker``: a run's
spec, plan and admission) are the values ``__init__`` makes, and a wrong call fails as it does."""

from __future__ import annotations

import dataclasses

import pytest

from relay.auth import Principal
from relay.providers.contract import Egress, Resources, SandboxSpec
from relay.runs.limits import admission_for
from relay.runs.planning import Candidate, Plan, make_plan, make_spec
from relay.settings import Settings
from relay.store.limits import Admission
from relay.store.records import maker


def _spec_fields() -> dict[str, object]:
    return {
        "run_id": "run_1",
        "cluster": "c",
        "timeout_s": 3.0,
        "grace_s": 30.0,
        "image": None,
        "resources": Resources(2.0, 4096, 4096),
        "egress": Egress(("example.com",)),
        "pip": ("requests",),
        "job": "noop",
        "attempt": None,
    }


def _plan_fields(spec: SandboxSpec) -> dict[str, object]:
    return {
        "job": "noop",
        "provider": "memory",
        "argv": ["true"],
        "env": {"A": "1"},
        "files": {"f": b"x"},
        "stdin": None,
        "workdir": None,
        "timeout_s": 3.0,
        "spec": spec,
        "route": (Candidate("memory", spec),),
        "retry_safe": True,
        "ranking": "order",
        "skipped": (),
        "artifacts": ("out.txt",),
        "artifacts_required": False,
        "artifacts_token_bytes": None,
    }


def test_a_spec_and_a_plan_made_without_init_equal_and_read_as_those_init_makes() -> None:
    for cls, make, fields in (
        (SandboxSpec, make_spec, _spec_fields()),
        (Plan, make_plan, _plan_fields(SandboxSpec(**_spec_fields()))),  # type: ignore[arg-type]
    ):
        made, built = make(**fields), cls(**fields)
        assert type(made) is cls
        assert made == built
        assert vars(made) == vars(built) and list(vars(made)) == list(vars(built))
        assert repr(made) == repr(built)
        assert dataclasses.replace(made, job="other") == dataclasses.replace(built, job="other")
        with pytest.raises(dataclasses.FrozenInstanceError):
            made.job = "other"  # type: ignore[misc]
    spec_fields = _spec_fields()
    assert hash(make_spec(**spec_fields)) == hash(SandboxSpec(**spec_fields))  # type: ignore[arg-type]


def test_a_maker_given_fewer_fields_fills_the_defaults_as_init_does() -> None:
    fields = _spec_fields()
    del fields["attempt"], fields["egress"], fields["pip"]
    assert make_spec(**fields) == SandboxSpec(**fields)  # type: ignore[arg-type]
    assert make_spec(**fields).egress == Egress()


def test_a_maker_refuses_a_misspelt_or_missing_field_as_init_does() -> None:
    fields = _spec_fields()
    fields["atempt"] = fields.pop("attempt")  # as many fields, one of them misspelt
    with pytest.raises(TypeError, match="atempt"):
        make_spec(**fields)
    fields = _spec_fields()
    del fields["run_id"]
    with pytest.raises(TypeError, match="run_id"):
        make_spec(**fields)


def test_a_maker_is_refused_for_a_class_whose_init_does_more() -> None:
    @dataclasses.dataclass(frozen=True)
    class Checked:
        value: int

        def __post_init__(self) -> None:
            assert self.value >= 0

    with pytest.raises(TypeError, match="__post_init__"):
        maker(Checked)


def test_an_admission_made_for_a_run_is_the_one_its_init_makes() -> None:
    principal = Principal("t", max_concurrent=2, runs_per_day=5, usd_per_day=1.5)
    settings = Settings(_env_file=None, max_concurrent=10, token_share=0.5)  # type: ignore[call-arg]
    made = admission_for(principal, settings, 100.0, {"run_1": 0.5}, ("a", "b"), {"b": 3})
    assert type(made) is Admission
    assert made == Admission(
        token_concurrent=2,
        global_concurrent=10,
        runs_per_day=5,
        usd_per_day=1.5,
        now=100.0,
        token_share=5,
        settled={"run_1": 0.5},
        caps=(("a", None), ("b", 3)),
    )
    assert list(vars(made)) == [field.name for field in dataclasses.fields(Admission)]
