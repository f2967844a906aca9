"""The built-in example MCP server (stdio): a calculator and a key-value lookup, for ``agents.mcp_tools``.

python -m ajet_hpc.agents.calculator_mcp     # speaks MCP on stdin/stdout
"""

from __future__ import annotations

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

TABLE = {"alpha": 17, "beta": 42, "gamma": 7, "delta": 123, "omega": 999}

server = MCPServer("ajet-calculator", log_level="WARNING")  # its stderr goes to the client task's log


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


@server.tool()
def lookup(key: str) -> int:
    """The number stored under a key."""
    if key not in TABLE:
        raise ToolError(f"no key {key!r}; the keys are {sorted(TABLE)}")
    return TABLE[key]


if __name__ == "__main__":
    server.run("stdio")
