"""The calculator of examples/calculator.yaml as an MCP server, on the mcp SDK's MCPServer:
examples/mcp-calculator.yaml starts it over stdio (`python -m examples.mcp_calculator_server`, from the
repository root); `python -m examples.mcp_calculator_server http 8000` serves it at http://127.0.0.1:8000/mcp."""

import re
import sys

from mcp.server.mcpserver import MCPServer

server = MCPServer("calculator", log_level="WARNING")
EXPRESSION = re.compile(r"\s*-?\d+(\s*[-+*]\s*-?\d+)*\s*")


@server.tool()
def calculator(expression: str) -> str:
    """The value of an integer expression over + - * (at most 64 characters), or "" when it is not one."""
    if len(expression) > 64 or not EXPRESSION.fullmatch(expression):
        return ""
    canonical = re.sub(r"\d+", lambda number: str(int(number.group())), expression)  # "07" is 7
    return str(eval(canonical, {"__builtins__": {}}, {}))  # noqa: S307 (digits, + - * and spaces only)


if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
