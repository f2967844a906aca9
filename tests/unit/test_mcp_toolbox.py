"""The MCP toolbox against the built-in calculator server, reached both ways an agent can: started beside
the task on stdio, and running elsewhere behind a URL (streamable HTTP). The training run through it is in
tests/component/test_environments.py."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from ajet_hpc.environments.mcp_tools import McpToolbox, McpToolError, openai_tool


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def http_server():
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "ajet_hpc.environments.calculator.mcp_server", "--http", str(port)]
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.2)
    yield f"http://127.0.0.1:{port}/mcp"
    process.terminate()
    process.wait(10)


@pytest.mark.parametrize("way", ["stdio", "http"])
def test_tools_are_listed_as_openai_tools_and_called_from_many_threads(way: str, request) -> None:
    server = [sys.executable, "-m", "ajet_hpc.environments.calculator.mcp_server"]
    toolbox = McpToolbox(request.getfixturevalue("http_server") if way == "http" else server)
    try:
        (add,) = toolbox.openai_tools(["add"])
        assert add["function"]["parameters"] == {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        }
        with ThreadPoolExecutor(8) as pool:  # agents call from the runner's threads
            sums = list(pool.map(lambda k: toolbox.call("add", {"a": k, "b": 1}), range(16)))
        assert sums == [(str(k + 1), False) for k in range(16)]
        text, is_error = toolbox.call("lookup", {"key": "nope"})
        assert is_error and "no key 'nope'" in text  # a tool's error goes back to the model as text
        with pytest.raises(McpToolError, match="no tool"):
            toolbox.openai_tools(["divide"])
    finally:
        toolbox.close()


def test_a_server_that_cannot_start_or_a_bad_spec_is_named() -> None:
    with pytest.raises(ValueError, match="give a command as a list"):
        McpToolbox("my_server")
    broken = McpToolbox([sys.executable, "-c", "import sys; sys.exit(3)"])
    with pytest.raises(McpToolError, match="cannot connect to MCP server"):
        broken.openai_tools()


def test_generated_titles_are_dropped_but_a_parameter_named_title_is_kept() -> None:
    schema = {
        "title": "noteArguments",
        "type": "object",
        "properties": {"title": {"title": "Title", "type": "string"}},
        "$defs": {"Inner": {"title": "Inner", "type": "object"}},
    }
    tool = SimpleNamespace(name="note", description=None, input_schema=schema)  # as mcp lists one
    assert openai_tool(tool)["function"] == {
        "name": "note",
        "description": "",
        "parameters": {
            "type": "object",
            "properties": {"title": {"type": "string"}},
            "$defs": {"Inner": {"type": "object"}},
        },
    }
