"""A run and a webhook delivery as the store reads and writes them: typed, one field a column.

The store answers with a :class:`RunRecord` (frozen: a changed run is a new record, made
with :meth:`RunRecord.changed`) and takes a change as :class:`RunValues`, whose keys
mypy checks, so a misspelt column is a type error where the write is written. The
fields and the table's columns are checked against each other at import
(relay/store/schema.py holds the table).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict, TypeVar, Unpack

from relay.run_state import RunState
from relay.store.schema import deliveries, runs


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """One row of ``runs``. Defaults are the schema's, so a new run names only what it knows.

    A record from a listing (``Store.list_runs``) carries no output (``stdout`` and
    ``stderr`` empty), only its sizes (``stdout_bytes``, ``stderr_bytes``).
    """

    id: str
    token: str
    job: str | None = None
    provider: str
    state: RunState
    idempotency_key: str | None = None
    request_hash: str
    sandbox_id: str | None = None
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    stdout_bytes: int | None = None
    stderr_bytes: int | None = None
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timeout_s: float
    cpu: float = 1.0
    memory_mb: int = 1024
    created_at: float
    started_at: float | None = None
    ended_at: float | None = None
    deadline: float
    duration_ms: int | None = None
    cost_usd: float = 0.0
    reserved_usd: float = 0.0
    sandbox_s: float = 0.0
    timings: str = "{}"
    """The run's step timings in milliseconds, as a JSON object."""
    error_code: str | None = None
    error_message: str | None = None
    error_retry_after_s: float | None = None
    owner: str
    cancel_requested: bool = False
    callback_url: str | None = None
    request: str | None = None
    """What was asked, as a JSON object without secrets (``request_echo``); None before
    schema 8, and in a listing."""
    attempts: str | None = None
    """A route's attempts, as a JSON list (relay/runs/view.py shows them); None when the
    first attempt ran the command."""
    artifacts: str | None = None
    """Its artifacts' listing, a JSON array (relay/runs/artifacts.py); None when it declared
    none, and in a listing."""

    def __post_init__(self) -> None:
        if not isinstance(self.state, RunState):  # the column's text, from an untyped caller
            object.__setattr__(self, "state", RunState(self.state))

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> RunRecord:
        """The record of a row read from ``runs`` (a listing's lacks the output). Built
        without ``__init__``: a frozen dataclass sets each of its 33 fields through
        ``object.__setattr__``, ten times what a listing of 200 runs should cost."""
        values = {**_RUN_DEFAULTS, **row}
        values["state"] = _STATES[values["state"]]  # the column's text, as the enum
        record = object.__new__(cls)
        object.__setattr__(record, "__dict__", values)
        return record

    @classmethod
    def new(cls, id: str, **values: Unpack[RunValues]) -> RunRecord:
        """A new run's record: what ``RunRecord(id=..., ...)`` makes, the same TypeError for
        a column missing or misspelt, at a quarter of its cost (the frozen ``__init__``
        sets each of the 36 fields through ``object.__setattr__``; every run makes one)."""
        fields = _RUN_TEMPLATE.copy()
        fields["id"] = id
        fields.update(values)  # the template's keys keep their place: the columns' order
        if len(fields) != len(_RUN_TEMPLATE) or not values.keys() >= _RUN_REQUIRED_VALUES:
            unknown = sorted(values.keys() - _RUN_TEMPLATE.keys())
            if unknown:
                raise TypeError(f"RunRecord has no column {unknown}")
            missing = [name for name in _RUN_REQUIRED if fields[name] is _UNSET]
            raise TypeError(f"RunRecord needs {missing}")
        if not isinstance(fields["state"], RunState):  # the column's text, from an untyped caller
            fields["state"] = RunState(fields["state"])
        record = object.__new__(cls)
        object.__setattr__(record, "__dict__", fields)
        return record

    def changed(self, **values: Unpack[RunValues]) -> RunRecord:
        """This run with ``values`` changed: what :func:`dataclasses.replace` does, a
        misspelt column a TypeError as there, at a tenth of its cost (each run makes a few)."""
        if not _RUN_TEMPLATE.keys() >= values.keys():
            unknown = values.keys() - _RUN_TEMPLATE.keys()
            raise TypeError(f"RunRecord has no column {sorted(unknown)}")
        record = object.__new__(RunRecord)
        object.__setattr__(record, "__dict__", {**vars(self), **values})
        return record

    def columns(self) -> dict[str, Any]:
        """Every column's value, as an INSERT takes them: NULLs left out (the INSERT then
        names fewer columns, and the fast path binds fewer values)."""
        return {name: value for name, value in vars(self).items() if value is not None}


class RunValues(TypedDict, total=False):
    """Columns a write changes (every column but the id), each with its type."""

    token: str
    job: str | None
    provider: str
    state: RunState
    idempotency_key: str | None
    request_hash: str
    sandbox_id: str | None
    exit_code: int | None
    stdout: str
    stderr: str
    stdout_bytes: int | None
    stderr_bytes: int | None
    stdout_truncated: bool
    stderr_truncated: bool
    timeout_s: float
    cpu: float
    memory_mb: int
    created_at: float
    started_at: float | None
    ended_at: float | None
    deadline: float
    duration_ms: int | None
    cost_usd: float
    reserved_usd: float
    sandbox_s: float
    timings: str
    error_code: str | None
    error_message: str | None
    error_retry_after_s: float | None
    owner: str
    cancel_requested: bool
    callback_url: str | None
    request: str | None
    attempts: str | None
    artifacts: str | None


@dataclass(frozen=True, kw_only=True)
class DeliveryRecord:
    """One row of ``deliveries``: a finished run's webhook, sent until it lands."""

    id: str
    run_id: str
    token: str
    url: str
    state: str
    attempts: int
    attempt_log: str
    """Each attempt's outcome, as a JSON list."""
    created_at: float
    next_attempt_at: float
    lease_owner: str | None = None
    lease_until: float | None = None


Frozen = TypeVar("Frozen")


def maker(cls: type[Frozen]) -> Callable[..., Frozen]:
    """A function making ``cls`` (a frozen dataclass without ``__post_init__``) from its
    fields by keyword: given every field, the instance ``cls(**values)`` is, equal to it,
    without the frozen ``__init__``'s ``object.__setattr__`` a field (a run's plan, its spec and
    its admission are made for every run: the plan 2.0 us that way and 1.1 this one, the
    spec 1.5 and 0.8; :meth:`RunRecord.new` is the same for a record, with its defaults);
    given fewer (defaults to fill, a field misspelt or missing), ``cls(**values)`` itself."""
    if hasattr(cls, "__post_init__") or not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} must be a dataclass without __post_init__")
    template = dict.fromkeys(field.name for field in dataclasses.fields(cls))
    count = len(template)
    new = object.__new__
    set_attribute = object.__setattr__

    def make(**values: Any) -> Frozen:
        if len(values) != count:
            return cls(**values)
        fields = template.copy()
        fields.update(values)  # the template's keys keep their place: the fields' order
        if len(fields) != count:  # a name that is not a field (and so one missing)
            return cls(**values)  # its own TypeError
        made = new(cls)
        set_attribute(made, "__dict__", fields)
        return made

    return make


_STATES = {state.value: state for state in RunState}
_RUN_DEFAULTS = {
    field.name: field.default
    for field in dataclasses.fields(RunRecord)
    if field.default is not dataclasses.MISSING
}
_UNSET: Any = object()
_RUN_TEMPLATE: dict[str, Any] = {
    field.name: _UNSET if field.default is dataclasses.MISSING else field.default
    for field in dataclasses.fields(RunRecord)
}
"""Every column in order, with its default (``_UNSET``: none): :meth:`RunRecord.new`'s start."""
_RUN_REQUIRED = tuple(name for name, value in _RUN_TEMPLATE.items() if value is _UNSET)
_RUN_REQUIRED_VALUES = frozenset(_RUN_REQUIRED) - {"id"}
"""What :meth:`RunRecord.new` must be given by keyword (the id is its first argument)."""


def _check(record: type[Any], names: list[str], table_columns: list[str]) -> None:
    if names != table_columns:
        raise TypeError(f"{record.__name__} does not match its table: {names} != {table_columns}")


_check(RunRecord, [field.name for field in dataclasses.fields(RunRecord)], list(runs.c.keys()))
_check(RunValues, ["id", *RunValues.__annotations__], list(runs.c.keys()))
_check(
    DeliveryRecord,
    [field.name for field in dataclasses.fields(DeliveryRecord)],
    list(deliveries.c.keys()),
)
