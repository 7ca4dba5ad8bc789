"""Job manifests: loaded, validated with the file and field named, rendered without a shell."""

from __future__ import annotations

from pathlib import Path

import pytest

from relay.errors import ConfigError, InvalidParams
from relay.runs.catalog import MAX_WARM, Catalog, load_job
from tests.conftest import REPO


def write_job(root: Path, name: str, text: str, files: dict[str, str] | None = None) -> Path:
    directory = root / name
    directory.mkdir(parents=True)
    (directory / "job.toml").write_text(text)
    for relative, content in (files or {}).items():
        (directory / relative).write_text(content)
    return directory


def test_the_shipped_examples_load() -> None:
    catalog = Catalog.load(REPO / "jobs")
    assert {"echo", "python", "http-status"} <= set(catalog.jobs)
    assert catalog.jobs["http-status"].files["check.py"].startswith(b'"""Print')


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('command = "echo hi"', "command"),
        ("command = []", "command"),
        ('command = ["echo"]\nbogus = 1', "bogus"),
        ('command = ["echo", "{missing}"]', "{missing}"),
        ('command = ["echo"]\nsize = "huge"', "size"),
        ('command = ["echo"]\ntimeout_s = 0', "timeout_s"),
        ('command = ["echo"]\negress = ["*", "a.com"]', "egress"),
        ('command = ["echo"]\nallow = ["command"]', "allow"),
        ('command = ["echo"]\nfiles = ["nope.py"]', "files"),
        ('command = ["echo"]\nfiles = ["../../etc/passwd"]', "files"),
        ('command = ["echo"]\n[params.x]\ntype = "float"', "params.x.type"),
        ('command = ["echo"]\ncomand = ["x"]', "comand: unknown field (did you mean 'command'?)"),
        (
            'command = ["echo"]\n[params.x]\ntype = "string"\nmax_length = 3\nallow_dash = true',
            "params.x.allow_dash: unknown field (did you mean 'allow_leading_dash'?)",
        ),
        (
            'command = ["echo"]\n[params.x]\ntype = "string"\nmax_length = 3\n'
            'allow_leading_dash = "yes"',
            "params.x.allow_leading_dash: must be true or false",
        ),
        (
            'command = ["echo"]\n[params.x]\ntype = "string"\nmax_length = 3\ndefault = "-v"',
            "params.x.default",
        ),
        ('command = ["echo"]\nenv = { SANDBOX_ID = "x" }', "env: SANDBOX_ID"),
        (
            'command = ["echo"]\n[params.x]\ntype = "integer"\nenv = "SANDBOX_ID"',
            "params.x.env",
        ),
        ('command = ["echo"]\n[params.x]\ntype = "string"', "params.x.max_length"),
        ('command = ["echo"]\n[params.x]\ntype = "array"\nmax_length = 3', "params.x.max_items"),
        (
            'command = ["echo"]\n[params.x]\ntype = "string"\nmax_length = 3\npattern = "("',
            "params.x.pattern",
        ),
        (
            'command = ["echo"]\n[params.x]\ntype = "integer"\nmax = 3\ndefault = 9',
            "params.x.default",
        ),
        ("command = [", "not valid TOML"),
        ('command = ["echo"]\nwarm = -1', "warm: must be a whole number from 0 to 64"),
        ('command = ["echo"]\nwarm = true', "warm: must be a whole number"),
    ],
)
def test_a_bad_manifest_names_file_and_field(tmp_path: Path, text: str, field: str) -> None:
    write_job(tmp_path, "bad", text)
    with pytest.raises(ConfigError) as caught:
        Catalog.load(tmp_path)
    assert str(tmp_path / "bad" / "job.toml") in caught.value.message
    assert field in caught.value.message


def test_a_manifest_that_is_not_utf8_names_its_file(tmp_path: Path) -> None:
    manifest = write_job(tmp_path, "latin", 'command = ["echo"]\n') / "job.toml"
    manifest.write_bytes('description = "caf\u00e9"\ncommand = ["echo"]\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match=f"{manifest}: not UTF-8 text"):
        Catalog.load(tmp_path)


def test_render_keeps_params_whole(tmp_path: Path) -> None:
    job = load_job(
        write_job(
            tmp_path,
            "j",
            """
command = ["tool", "{items}", "--name={name}", "{name}", "{flag}"]
params_file = true
[params.items]
type = "array"
max_items = 5
max_length = 50
[params.name]
type = "string"
max_length = 50
env = "NAME"
[params.flag]
type = "boolean"
default = false
""",
        )
    )
    values = job.resolve_params({"items": ["a b", "$(x)"], "name": "; rm -rf /"})
    argv, env, files = job.render(values)
    assert argv == ["tool", "a b", "$(x)", "--name=; rm -rf /", "; rm -rf /", "false"]
    assert env == {"NAME": "; rm -rf /"}
    assert files["params.json"] == (
        b'{"flag": false, "items": ["a b", "$(x)"], "name": "; rm -rf /"}'
    )


def test_param_edges(tmp_path: Path) -> None:
    job = load_job(
        write_job(
            tmp_path,
            "j",
            """
command = ["x", "{n}"]
[params.n]
type = "integer"
min = 1
max = 3
required = true
""",
        )
    )
    assert job.resolve_params({"n": 1}) == {"n": 1}
    assert job.resolve_params({"n": 3}) == {"n": 3}
    for bad in (0, 4, "2", 2.0, True, None):
        with pytest.raises(InvalidParams):
            job.resolve_params({"n": bad})
    with pytest.raises(InvalidParams, match="required"):
        job.resolve_params({})


def test_per_provider_images(tmp_path: Path) -> None:
    job = load_job(write_job(tmp_path, "j", 'command = ["x"]\nimage = "python:3.12"\n'
                                            'images = { e2b = "base", vercel = "" }\n'))  # fmt: skip
    from relay.runs.planning import image_for

    assert image_for("e2b", None, job, job.image) == "base"
    assert image_for("vercel", None, job, job.image) is None
    assert image_for("modal", None, job, job.image) == "python:3.12"
    assert image_for("modal", "mine:1", job, job.image) == "mine:1"
    with pytest.raises(ConfigError, match="images"):
        load_job(write_job(tmp_path, "k", 'command = ["x"]\nimages = { e2b = 1 }\n'))


@pytest.mark.parametrize("name", ["run_command", "get_run"])
def test_a_job_may_not_take_the_name_of_an_mcp_tool(tmp_path: Path, name: str) -> None:
    """/mcp lists each job as a tool of its name beside its own two: a job named like one
    would be unreachable, or show a raw-command tool to a token without the scope."""
    write_job(tmp_path, name, 'command = ["echo"]')
    with pytest.raises(ConfigError) as caught:
        Catalog.load(tmp_path)
    assert "/mcp" in caught.value.message


def test_warm_is_taken_up_to_its_bound_and_refused_past_it(tmp_path: Path) -> None:
    write_job(tmp_path, "most", f'command = ["echo"]\nwarm = {MAX_WARM}')
    assert Catalog.load(tmp_path).jobs["most"].warm == MAX_WARM
    write_job(tmp_path, "more", f'command = ["echo"]\nwarm = {MAX_WARM + 1}')
    with pytest.raises(ConfigError) as caught:
        Catalog.load(tmp_path)
    assert "warm: must be a whole number from 0" in caught.value.message
