"""``/mcp`` through the ``mcp`` SDK's own client, over real HTTP, against a real relay
(the local provider with bubblewrap): tools per token, runs, errors, limits, progress,
timeouts and cancellation with the sandbox verified gone, auth, and fuzzed arguments.

Every tool result is checked against its tool's ``outputSchema`` with a JSON Schema
validator, as the TypeScript SDK's client checks it (this SDK's skips error results)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import httpx2
import psutil
import pytest
from anyio.from_thread import start_blocking_portal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client
from mcp.types import CallToolResult, ListToolsResult, TextContent

from relay.http.mcp_tools import job_schema
from relay.runs.catalog import Catalog
from testing.host import sleep_marker
from testing.postgres import own_postgres
from testing.relay_server import SECRET_CANARY, RelayProcess
from tests.conftest import new_database

pytestmark = pytest.mark.slow  # needs a relay process: seconds

MAX_WAIT_S = 2


class Recording(httpx2.AsyncBaseTransport):
    """Every byte the client sends and receives on /mcp, for the canary check."""

    def __init__(self, seen: bytearray) -> None:
        self.inner = httpx2.AsyncHTTPTransport()
        self.seen = seen

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        self.seen += request.content
        response = await self.inner.handle_async_request(request)
        seen = self.seen

        class Tee(httpx2.AsyncByteStream):
            async def __aiter__(self) -> AsyncIterator[bytes]:
                async for chunk in response.stream:  # type: ignore[union-attr]
                    seen.extend(chunk)
                    yield chunk

            async def aclose(self) -> None:
                await response.aclose()

        return httpx2.Response(
            response.status_code,
            headers=response.headers,
            stream=Tee(),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self.inner.aclose()


SEEN = bytearray()
"""Every byte of every test's /mcp traffic."""


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    server = RelayProcess(
        tmp_path_factory.mktemp("relay"),
        max_wait_s=MAX_WAIT_S,
        max_output_bytes=65536,
        local_isolation="bwrap",
    )
    server.add_token("ops", command=True)
    server.add_token("echo-only", jobs=["echo"])
    server.add_token("once", jobs=["echo"], limits={"runs_per_day": 1})
    server.start()
    yield server
    server.stop()
    log = server.log()
    assert SECRET_CANARY not in log
    assert "unhandled error" not in log and "mcp tool failed" not in log


def conform(result: CallToolResult, schema: dict[str, Any] | None) -> None:
    """What the TypeScript SDK's client demands of a tool with an ``outputSchema``: structured
    content, unless the result is an error, and whatever structured content there is (on an
    error too) valid against the schema."""
    if schema is None:
        return
    if result.structured_content is None:
        assert result.is_error, "a tool with an outputSchema answered no structured content"
        return
    validator = Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
    errors = [error.message for error in validator.iter_errors(result.structured_content)]
    assert not errors, errors


class Checked:
    """The SDK's client, with every tool result checked by :func:`conform`."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.schemas: dict[str, dict[str, Any] | None] = {}

    async def list_tools(self) -> ListToolsResult:
        listed = await self.client.list_tools()
        self.schemas.update({tool.name: tool.output_schema for tool in listed.tools})
        return listed

    async def call_tool(
        self, name: str, arguments: dict[str, Any], **options: Any
    ) -> CallToolResult:
        if name not in self.schemas:
            await self.list_tools()  # as a host has: the schemas come with the list
        result = await self.client.call_tool(name, arguments, **options)
        conform(result, self.schemas.get(name))
        return result


@contextlib.asynccontextmanager
async def connect(relay: RelayProcess, token: str, mode: str = "legacy") -> AsyncIterator[Checked]:
    http = httpx2.AsyncClient(
        headers={"Authorization": f"Bearer {token}"},
        timeout=httpx2.Timeout(30, read=60),
        transport=Recording(SEEN),
    )
    async with (
        http,
        Client(streamable_http_client(relay.url + "/mcp", http_client=http), mode=mode) as client,
    ):
        yield Checked(client)


def text(result: CallToolResult) -> str:
    first = result.content[0]
    assert isinstance(first, TextContent)
    return first.text


def structured(result: CallToolResult) -> dict[str, Any]:
    assert result.structured_content is not None
    return dict(result.structured_content)


def refusal(result: CallToolResult, code: str) -> str:
    """The text of a refused call, which names the relay's error ``code`` as /v1 does; a
    refusal carries no structured content (it would not be a Run)."""
    assert result.is_error and result.structured_content is None, result
    assert len(result.content) == 1
    assert text(result).startswith(f"{code}: "), text(result)
    return text(result)


def sandbox_processes(marker: str) -> list[list[str]]:
    return [
        p.info["cmdline"]
        for p in psutil.process_iter(["cmdline"])
        if p.info["cmdline"] and p.info["cmdline"][:2] == ["sleep", marker]
    ]


async def latest_run(relay: RelayProcess, token: str, state: str) -> dict[str, Any]:
    """The token's newest run once it has reached ``state`` (5 s at most)."""
    for _ in range(50):
        runs: list[dict[str, Any]] = relay.get(token, "/v1/runs", limit=1).json()["runs"]
        if runs and runs[0]["state"] == state:
            return runs[0]
        await anyio.sleep(0.1)
    raise AssertionError(f"no run reached {state}: {runs}")


async def test_tools_follow_the_catalog_and_the_token(relay: RelayProcess) -> None:
    catalog = Catalog.load(relay.jobs_dir)
    async with connect(relay, relay.tokens["echo-only"]) as client:
        tools = (await client.list_tools()).tools
    assert [tool.name for tool in tools] == ["echo", "get_run"]
    echo = tools[0]
    assert echo.description == catalog.jobs["echo"].description
    assert echo.input_schema == job_schema(catalog.jobs["echo"])
    message = echo.input_schema["properties"]["message"]
    assert message["type"] == "string" and message["maxLength"] == 1000
    assert echo.input_schema["required"] == ["message"]

    async with connect(relay, relay.tokens["ops"], mode="auto") as client:
        tools = (await client.list_tools()).tools
    by_name = {tool.name: tool for tool in tools}
    assert set(by_name) == {*catalog.jobs, "run_command", "get_run"}
    params = by_name["params"].input_schema["properties"]
    assert params["count"] == {"type": "integer", "minimum": 1, "maximum": 10, "default": 2}
    assert params["tags"]["items"]["pattern"] == "^(?:[a-z]+)$"
    assert params["tags"]["maxItems"] == 3 and params["flag"] == {"type": "boolean"}
    assert "timeout_s" in by_name["sleep"].input_schema["properties"]  # the job allows it
    assert "stdin" not in by_name["sleep"].input_schema["properties"]  # it does not
    assert by_name["run_command"].input_schema["required"] == ["command"]
    assert by_name["run_command"].input_schema["properties"]["size"]["enum"] == [
        "small",
        "medium",
        "large",
    ]


async def test_the_list_follows_a_change_of_the_tokens_scopes(relay: RelayProcess) -> None:
    token = relay.add_token("growing", jobs=["echo"])
    async with connect(relay, token) as client:
        before = [tool.name for tool in (await client.list_tools()).tools]
        tokens_toml = relay.tokens_file.read_text()
        block = tokens_toml.index("[tokens.growing]")
        grown = tokens_toml[block:].replace('jobs = ["echo"]', 'jobs = ["echo", "sleep"]', 1)
        relay.tokens_file.write_text(tokens_toml[:block] + grown)
        after = [tool.name for tool in (await client.list_tools()).tools]
    assert before == ["echo", "get_run"]
    assert after == ["echo", "sleep", "get_run"]


async def test_a_tool_call_is_a_run(relay: RelayProcess) -> None:
    token = relay.tokens["echo-only"]
    async with connect(relay, token) as client:
        result = await client.call_tool("echo", {"message": "hi", "idempotency_key": "mcp-1"})
        again = await client.call_tool("echo", {"message": "hi", "idempotency_key": "mcp-1"})
    assert not result.is_error and text(result) == "hi\n"
    run = structured(result)
    assert run["state"] == "succeeded" and run["exit_code"] == 0 and run["provider"] == "local"
    assert structured(again)["id"] == run["id"]  # the same key: the same run, no second one
    listed = relay.get(token, "/v1/runs", job="echo").json()["runs"]
    assert [r["id"] for r in listed].count(run["id"]) == 1
    assert relay.get(token, f"/v1/runs/{run['id']}").json()["stdout"] == "hi\n"
    metrics = relay.get(None, "/metrics").text
    assert 'relay_runs_total{job="echo",provider="local",state="succeeded"}' in metrics


async def test_non_zero_exit_is_an_error_result(relay: RelayProcess) -> None:
    async with connect(relay, relay.tokens["ops"]) as client:
        result = await client.call_tool(
            "run_command", {"command": ["sh", "-c", "echo out; exit 7"]}
        )
    assert result.is_error and text(result) == "out\n"
    run = structured(result)
    assert (run["state"], run["exit_code"]) == ("failed", 7)


async def test_bad_arguments_are_tool_errors_with_the_relays_code(relay: RelayProcess) -> None:
    async with connect(relay, relay.tokens["ops"]) as client:
        long = await client.call_tool("echo", {"message": "x" * 1001})
        missing = await client.call_tool("params", {})
        typed = await client.call_tool("sleep", {"seconds": "5"})
        unknown = await client.call_tool("echo", {"message": "x", "stdin": "no"})
        command = await client.call_tool("run_command", {"command": []})
        option = await client.call_tool("echo", {"message": "--version"})
        with pytest.raises(MCPError):
            await client.call_tool("no-such-tool", {})
    for result, code in [
        (long, "invalid_params"),
        (missing, "invalid_params"),
        (typed, "invalid_params"),
        (unknown, "invalid_params"),
        (command, "validation_error"),
        (option, "invalid_params"),
    ]:
        refusal(result, code)
    assert "starts with '-'" in text(option)


async def test_a_tool_the_token_may_not_use_is_refused_as_v1_refuses_it(
    relay: RelayProcess,
) -> None:
    """A host may call a tool from a list made before the token lost it: the model reads
    `forbidden`, as POST /v1/runs answers, for a job whether it exists or not."""
    async with connect(relay, relay.tokens["echo-only"]) as client:
        command = await client.call_tool("run_command", {"command": ["id"]})
        sleep = await client.call_tool("sleep", {"seconds": 0})
        missing = await client.call_tool("no-such-job", {})
        with pytest.raises(MCPError):  # no job name: no tool, a protocol error
            await client.call_tool("No Such Tool", {})
    assert refusal(command, "forbidden") == "forbidden: this token may not run a raw command"
    assert refusal(sleep, "forbidden") == "forbidden: this token may not run job 'sleep'"
    assert refusal(missing, "forbidden") == "forbidden: this token may not run job 'no-such-job'"


async def test_a_limit_refuses_with_a_retry_hint(relay: RelayProcess) -> None:
    async with connect(relay, relay.tokens["once"]) as client:
        first = await client.call_tool("echo", {"message": "one"})
        second = await client.call_tool("echo", {"message": "two"})
    assert not first.is_error
    assert re.search(r"\(retry after [1-9][0-9]* s\)$", refusal(second, "rate_limited"))


async def test_a_timeout_ends_the_run_and_its_sandbox(relay: RelayProcess) -> None:
    seconds = sleep_marker(361)
    async with connect(relay, relay.tokens["ops"]) as client:
        result = await client.call_tool(
            "run_command",
            {"command": ["sh", "-c", f"echo started; sleep {seconds}"], "timeout_s": 1},
        )
    assert result.is_error and text(result) == "started\n"
    assert structured(result)["state"] == "timed_out"
    assert sandbox_processes(seconds) == []


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_canceling_the_call_cancels_the_run(relay: RelayProcess, mode: str) -> None:
    token = relay.tokens["ops"]
    seconds = sleep_marker(362)
    started = anyio.Event()

    async def progress(done: float, total: float | None, message: str | None) -> None:
        started.set()

    async with connect(relay, token, mode=mode) as client:
        with anyio.move_on_after(10) as scope:
            async with anyio.create_task_group() as group:

                async def call() -> None:
                    await client.call_tool(
                        "run_command",
                        {"command": ["sh", "-c", f"echo up; sleep {seconds}"]},
                        progress_callback=progress,
                    )

                group.start_soon(call)
                await started.wait()
                for _ in range(50):  # the output came first; `sleep` follows at once
                    if sandbox_processes(seconds):
                        break
                    await anyio.sleep(0.1)
                assert sandbox_processes(seconds)
                group.cancel_scope.cancel()
        assert not scope.cancelled_caught
        run = await latest_run(relay, token, "canceled")
    assert run["exit_code"] is None
    assert sandbox_processes(seconds) == []


async def test_output_arrives_as_progress_in_order(relay: RelayProcess) -> None:
    seen: list[tuple[float, str | None]] = []

    async def progress(done: float, total: float | None, message: str | None) -> None:
        seen.append((done, message))

    script = "for i in 1 2 3; do echo line$i; sleep 0.2; done; echo oops >&2"
    async with connect(relay, relay.tokens["ops"]) as client:
        result = await client.call_tool(
            "run_command", {"command": ["sh", "-c", script]}, progress_callback=progress
        )
    assert not result.is_error
    stdout = "".join(m or "" for _, m in seen if not (m or "").startswith("[stderr] "))
    assert stdout == "line1\nline2\nline3\n" == text(result)
    assert "[stderr] oops\n" in [m for _, m in seen]
    done = [d for d, _ in seen]
    assert done == sorted(done) and len(set(done)) == len(done)


async def test_a_run_past_max_wait_is_read_later_with_get_run(relay: RelayProcess) -> None:
    async with connect(relay, relay.tokens["ops"]) as client:
        started = time.monotonic()
        result = await client.call_tool("sleep", {"seconds": MAX_WAIT_S + 2})
        assert MAX_WAIT_S - 0.5 < time.monotonic() - started < MAX_WAIT_S + 1.5
        assert not result.is_error
        run = structured(result)
        assert run["state"] == "running" and "get_run" in str(result.content)
        for _ in range(40):
            later = await client.call_tool("get_run", {"run_id": run["id"]})
            if structured(later)["state"] != "running":
                break
            await anyio.sleep(0.25)
        missing = await client.call_tool("get_run", {"run_id": "run_nope"})
    assert structured(later)["state"] == "succeeded"
    assert text(later) == "sleeping\nwoke\n"
    refusal(missing, "not_found")


def test_no_token_no_session(relay: RelayProcess) -> None:
    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "t", "version": "1"},
        },
    }
    headers = {"Accept": "application/json, text/event-stream"}
    for token in (None, "rly_wrong"):
        answer = httpx.post(
            relay.url + "/mcp", json=initialize, headers=relay.headers(token, **headers)
        )
        assert answer.status_code == 401
        assert answer.json()["error"]["code"] == "unauthorized"
        challenge = 'Bearer realm="relay"' + (', error="invalid_token"' if token else "")
        assert answer.headers["www-authenticate"] == challenge
        assert "mcp-session-id" not in answer.headers
    good = httpx.post(
        relay.url + "/mcp", json=initialize, headers=relay.headers(relay.tokens["ops"], **headers)
    )
    assert good.status_code == 200 and good.headers["mcp-session-id"]
    # Another token cannot use that session.
    stolen = httpx.post(
        relay.url + "/mcp",
        json={"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
        headers=relay.headers(
            relay.tokens["echo-only"],
            **headers,
            **{"Mcp-Session-Id": good.headers["mcp-session-id"]},
        ),
    )
    assert stolen.status_code == 404


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
argument_names = st.sampled_from(
    [
        *("message", "name", "tags", "count", "flag", "seconds", "command", "timeout_s"),
        *("env", "files", "stdin", "idempotency_key", "run_id", "size", "egress", "workdir"),
    ]
) | st.text(max_size=8)


def test_fuzzed_arguments_never_fail_the_relay(relay: RelayProcess) -> None:
    """Any arguments to any tool: a result or a tool error, never a 500, never a hang."""

    with (
        start_blocking_portal() as portal,
        portal.wrap_async_context_manager(connect(relay, relay.tokens["ops"])) as client,
    ):

        @settings(
            max_examples=40,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture],
        )
        @given(
            tool=st.sampled_from(["echo", "params", "sleep", "run_command", "get_run"]),
            arguments=st.dictionaries(argument_names, json_values, max_size=4),
        )
        def call(tool: str, arguments: dict[str, Any]) -> None:
            if tool == "sleep" and isinstance(arguments.get("seconds"), int):
                arguments["seconds"] = min(arguments["seconds"], 1)  # bounded
            if tool == "run_command":
                arguments["timeout_s"] = 1  # whatever it runs, it is over in a second
            result = portal.call(_call, client, tool, arguments)
            assert isinstance(result, CallToolResult)
            assert not text(result).startswith("internal: "), text(result)

        call()
        assert SECRET_CANARY not in SEEN.decode(errors="replace")


async def _call(client: Checked, tool: str, arguments: dict[str, Any]) -> CallToolResult:
    with anyio.fail_after(20):
        return await client.call_tool(tool, arguments)


async def test_the_secret_canary_is_in_no_mcp_message(relay: RelayProcess) -> None:
    async with connect(relay, relay.tokens["ops"]) as client:
        result = await client.call_tool("run_command", {"command": ["env"]})
        tools = await client.list_tools()
    assert not result.is_error and "PATH=" in text(result)
    assert tools.tools
    assert len(SEEN) > 10_000  # every test's traffic went through it
    assert SECRET_CANARY not in SEEN.decode(errors="replace")


@pytest.mark.postgres
async def test_a_store_outage_mid_call_answers_the_outcome_then_store_unavailable(
    tmp_path: Path,
) -> None:
    """PostgreSQL stops while a tool call's run is in flight: the call still gets the run's
    outcome (kept in memory), and a call while it is away is `store_unavailable`, not an
    internal error."""
    with own_postgres() as (outage, server_url):
        url = await new_database(server_url)
        server = RelayProcess(tmp_path, database_url=url, local_isolation="bwrap", drain_s=1)
        token = server.add_token("ops", command=True)
        server.start()
        try:
            async with connect(server, token) as client:
                command = {"command": ["sh", "-c", "sleep 1.5; echo kept"]}
                call = asyncio.create_task(client.call_tool("run_command", command))
                await anyio.sleep(0.7)  # running
                outage.stop()
                result = await asyncio.wait_for(call, 10)
                refused = await client.call_tool("run_command", {"command": ["true"]})
        finally:
            server.stop()
    assert not result.is_error and text(result) == "kept\n"
    refusal(refused, "store_unavailable")
    assert "mcp tool failed" not in server.log()


async def test_a_runs_artifacts_are_resource_links_and_small_text_is_embedded(
    relay: RelayProcess,
) -> None:
    from mcp.types import EmbeddedResource, ResourceLink, TextResourceContents

    async with connect(relay, relay.tokens["ops"]) as client:
        result = await client.call_tool("chart", {"bars": ["1", "2"]})
    assert not result.is_error, result
    run = structured(result)
    links = [block for block in result.content if isinstance(block, ResourceLink)]
    assert [(link.name, link.mime_type) for link in links] == [
        ("out/chart.png", "image/png"),
        ("out/report.json", "application/json"),
    ]
    assert str(links[0].uri) == f"/v1/runs/{run['id']}/artifacts/out/chart.png"
    (embedded,) = [block for block in result.content if isinstance(block, EmbeddedResource)]
    assert isinstance(embedded.resource, TextResourceContents)
    assert embedded.resource.text == '{"bars": [1, 2], "max": 2}\n'  # the report, not the PNG
