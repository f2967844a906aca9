"""The built-in example MCP server (stdio): the calculator's tools (``calculator.tools``) over MCP, for
``environments.mcp_tools``.

    python -m ajet_hpc.environments.calculator.mcp_server                  # speaks MCP on stdin/stdout
    python -m ajet_hpc.environments.calculator.mcp_server --http 8000      # streamable HTTP at http://127.0.0.1:8000/mcp
"""

from __future__ import annotations

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

from ajet_hpc.environments.calculator import tools as calculator

server = MCPServer("ajet-calculator", log_level="WARNING")  # its stderr goes to the client task's log
server.add_tool(calculator.add)
server.add_tool(calculator.multiply)


@server.tool()
def lookup(key: str) -> int:
    """The number stored under a key."""
    try:
        return calculator.lookup(key)
    except ValueError as exc:  # a failure MCP reports to the model as the tool's error text
        raise ToolError(str(exc)) from None


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--http"]:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run("stdio")
