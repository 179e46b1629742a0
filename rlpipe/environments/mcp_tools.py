"""An MCP server's tools as the `tools` environment's: {type: tools, options: {mcp: {command: [...]}}}.

The tools a Model Context Protocol server lists (`tools/list`) join the environment's tools; a model
turn that calls one is sent to the server (`tools/call`) and the text of its result is the observation.
    mcp: {command: [python, -m, my_server], env: {...}}   a server this process starts, over stdio
                                                          ("python": the interpreter running rlpipe)
    mcp: {url: http://tools:8000/mcp}                     a running server, over streamable HTTP
    mcp: {..., timeout_s: 30, connect_timeout_s: 60}      for each call; to start and connect
One connection per server per process, opened at the first trajectory's reset and shared by all that
follow, across steps of a long-lived process (the resident trainer): it lives on the process's background
event loop (rlpipe.environments.registry.background_loop), since the turn loop starts a fresh one every turn.
A tool's own error (MCP's `isError`, bad arguments) comes back as the observation "error: ...", as a Python
tool's does; a server that does not start, is unreachable, times out or drops the connection ends the
trajectory with an EnvironmentFailure naming the server (a failed connect is retried after RETRY_AFTER_S, so
one turn's trajectories share it).
"""

from __future__ import annotations

import asyncio
import atexit
import os
import sys
import tempfile
import threading
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

from rlpipe.environments.registry import EnvironmentFailure, background_loop

INSTALL = 'pip install -e ".[mcp]"'
RETRY_AFTER_S = 10.0


@dataclass(frozen=True)
class McpServer:
    """Where a server is: a command (stdio) or a URL (streamable HTTP)."""

    command: tuple[str, ...] = ()
    url: str = ""
    env: tuple[tuple[str, str], ...] = ()
    timeout_s: float = 30.0
    connect_timeout_s: float = 60.0

    def name(self) -> str:
        return f"MCP server {self.url or ' '.join(self.command)}"


def mcp_server(options: Any, key: str) -> McpServer:
    """The `mcp` option checked: ValueError naming the key and what to change."""
    if not isinstance(options, dict):
        raise ValueError(f"{key}: {{command: [program, args...]}} or {{url: http://host:port/mcp}}, got {options!r}")
    unknown = set(options) - {"command", "url", "env", "timeout_s", "connect_timeout_s"}
    if unknown:
        raise ValueError(
            f"{key}: unknown {sorted(unknown)}; mcp takes command or url, env, timeout_s, connect_timeout_s"
        )
    command, url = options.get("command"), options.get("url")
    if (command is None) == (url is None):
        raise ValueError(f"{key}: set one of command (a server started over stdio) or url (one over HTTP)")
    if command is not None and (
        not isinstance(command, list) or not command or not all(isinstance(c, str) for c in command)
    ):
        raise ValueError(f"{key}.command: a list of strings, e.g. [python, -m, my_server], got {command!r}")
    if url is not None and (not isinstance(url, str) or not url.startswith(("http://", "https://"))):
        raise ValueError(f"{key}.url: the server's streamable-HTTP endpoint, e.g. http://tools:8000/mcp, got {url!r}")
    env = options.get("env") or {}
    if not isinstance(env, dict):
        raise ValueError(f"{key}.env: a mapping of environment variables for the server, got {env!r}")
    timeouts = {
        name: options.get(name, default) for name, default in (("timeout_s", 30.0), ("connect_timeout_s", 60.0))
    }
    for name, value in timeouts.items():
        if not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"{key}.{name}: seconds to wait for the server (a number > 0), got {value!r}")
    try:
        import mcp  # noqa: F401
    except ImportError:
        raise ValueError(f"{key}: the MCP client is not installed: {INSTALL}") from None
    variables = tuple(sorted((str(k), str(v)) for k, v in env.items()))
    return McpServer(tuple(command or ()), url or "", variables, *map(float, timeouts.values()))


def root_error(err: BaseException) -> BaseException:
    """The first exception inside (nested) task-group exception groups."""
    while isinstance(err, BaseExceptionGroup) and err.exceptions:
        err = err.exceptions[0]
    return err


class McpConnection:
    """One client session to a server, on the process's background event loop."""

    def __init__(self, server: McpServer) -> None:
        self.server, self.pid, self.closed = server, os.getpid(), False
        self.tools: dict[str, Any] = {}  # name -> mcp.types.Tool
        self.session: Any = None
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self.stderr = tempfile.TemporaryFile("w+b")  # a stdio server's log, its end quoted when it fails
        self.stopping = asyncio.Event()  # bound to self.loop at its first wait (set only from there)
        self.loop = background_loop()
        self.main = asyncio.run_coroutine_threadsafe(self._serve(), self.loop)

    def _transport(self) -> Any:
        from mcp import StdioServerParameters, stdio_client
        from mcp.client.streamable_http import streamable_http_client

        if self.server.url:
            return streamable_http_client(self.server.url)
        program, *args = self.server.command
        program = sys.executable if program in ("python", "python3") else program
        parameters = StdioServerParameters(command=program, args=args, env=dict(self.server.env) or None)
        # mcp annotates errlog TextIO, but only hands it to the server's process as its stderr (any file)
        return stdio_client(parameters, errlog=self.stderr)  # type: ignore[arg-type]

    async def _serve(self) -> None:
        """Connect, list the tools, then hold the session open until close()."""
        import anyio
        from mcp import ClientSession

        try:
            async with AsyncExitStack() as stack:
                read, write = await stack.enter_async_context(self._transport())
                session = await stack.enter_async_context(ClientSession(read, write))
                with anyio.fail_after(self.server.connect_timeout_s):
                    await session.initialize()
                    listed = await session.list_tools()
                self.tools = {tool.name: tool for tool in listed.tools}
                self.session = session
                self.ready.set()
                await self.stopping.wait()
        except BaseException as err:  # noqa: BLE001 (recorded: connect() and call() name it)
            self.error = root_error(err)
        finally:
            self.session = None
            self.ready.set()

    def connect(self) -> None:
        """Wait until the session is open; EnvironmentFailure when it does not open."""
        if not self.ready.wait(self.server.connect_timeout_s + 10.0) and self.error is None:
            self.error = TimeoutError()
        if self.session is None:
            self.close()
            raise EnvironmentFailure(f"{self.server.name()} did not connect: {self.why()}")

    def why(self) -> str:
        """The recorded error in words, with the server's last stderr lines when it wrote any."""
        err = self.error
        if isinstance(err, TimeoutError):
            reason = f"no session within connect_timeout_s={self.server.connect_timeout_s} s"
        elif isinstance(err, OSError) and self.server.command:
            reason = f"the command does not start ({type(err).__name__}: {err}); fix mcp.command"
        else:
            reason = f"{type(err).__name__}: {err}" if err is not None else "it exited or hung up"
        self.stderr.seek(max(0, self.stderr.seek(0, 2) - 2000))
        log = self.stderr.read().decode(errors="replace").strip().splitlines()[-5:]
        return reason + (f"; its stderr ends: {' | '.join(line.strip() for line in log)}" if log else "")

    def alive(self) -> bool:
        return self.session is not None and self.pid == os.getpid()  # a forked child's session is its parent's

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        """The text of the tool's result ("error: ..." when the tool failed); EnvironmentFailure when the
        server does not answer."""
        future = asyncio.run_coroutine_threadsafe(self._call(name, arguments), self.loop)
        return await asyncio.wrap_future(future)

    async def _call(self, name: str, arguments: dict[str, Any]) -> str:
        from mcp import MCPError
        from mcp.types import CONNECTION_CLOSED, INVALID_PARAMS, REQUEST_TIMEOUT

        session = self.session
        if session is None:
            raise EnvironmentFailure(f"{self.server.name()} closed the connection: {self.why()}")
        try:
            result = await session.call_tool(name, arguments, read_timeout_seconds=self.server.timeout_s)
        except MCPError as err:
            if err.code == INVALID_PARAMS:  # the model's arguments: it sees why, as with a Python tool
                return f"error: {err.message}"
            if err.code == REQUEST_TIMEOUT:
                raise EnvironmentFailure(
                    f"{self.server.name()}: tool {name!r} timed out after timeout_s={self.server.timeout_s} s"
                ) from None
            if err.code == CONNECTION_CLOSED:  # the next reset opens a new session
                self.session = None
                self.stopping.set()
                raise EnvironmentFailure(f"{self.server.name()} closed the connection: {self.why()}") from None
            raise EnvironmentFailure(f"{self.server.name()}: tool {name!r} failed ({err.message})") from None
        text = "\n".join(block.text for block in result.content if getattr(block, "type", "") == "text")
        return f"error: {text}" if result.is_error else text

    def close(self) -> None:
        """End the session (a stdio server is stopped)."""
        if self.closed or self.pid != os.getpid():
            return  # closed already, or a forked child's copy (the parent owns the session)
        self.closed = True
        self.loop.call_soon_threadsafe(self.stopping.set)
        try:
            self.main.result(timeout=10.0)
        except Exception:  # noqa: BLE001, S110 (closing: nothing is lost)
            pass


def listed_tools(server: McpServer) -> list[str]:
    """The names of the tools `server` lists, on a connection opened and closed for this (`rlpipe check`)."""
    opened = McpConnection(server)
    opened.connect()
    names = list(opened.tools)
    opened.close()
    return names


OPEN: dict[McpServer, McpConnection] = {}
FAILED: dict[McpServer, tuple[float, EnvironmentFailure]] = {}
LOCK = threading.Lock()


def connection(server: McpServer) -> McpConnection:
    """This process's open connection to `server`, opened on first use; EnvironmentFailure when it cannot be."""
    with LOCK:
        failed_at, failure = FAILED.get(server, (float("-inf"), None))
        if failure is not None and time.monotonic() - failed_at < RETRY_AFTER_S:
            raise EnvironmentFailure(str(failure))
        opened = OPEN.get(server)
        if opened is None or not opened.alive():
            if opened is not None:
                opened.close()  # its server exited: its thread goes too
            opened = McpConnection(server)
            try:
                opened.connect()
            except EnvironmentFailure as err:
                FAILED[server] = (time.monotonic(), err)
                raise
            OPEN[server] = opened
            FAILED.pop(server, None)
        return opened


@atexit.register
def close_all() -> None:
    """Close every open connection (stdio servers are stopped, not left to notice a closed stdin)."""
    with LOCK:
        for opened in OPEN.values():
            opened.close()
        OPEN.clear()
