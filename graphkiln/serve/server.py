"""Serve an LLM over HTTP: bind the socket, say where, run uvicorn until a signal, close the LLM.

The socket is bound here rather than by uvicorn, before the model loads: a port in use is said at once,
and with `--port 0` the line on stderr names the port the system picked (tests and scripts read it).
It listens only once uvicorn runs, so a client is refused, not kept waiting, while the model loads.
Ctrl-C (or SIGTERM) stops accepting, gives open requests a few seconds, aborts the rest, frees the engine.
An engine that can serve nothing more (a tensor-parallel rank died) stops the server the same way, and `serve`
raises its error, so the command exits non-zero for whoever restarts it.
The engine's thread and the event loop each hold the interpreter lock in turn; `switch_interval` caps how long
one waits for the other (switch_interval.py).
"""

from __future__ import annotations

import ipaddress
import socket
import sys

import uvicorn

from graphkiln.errors import ConfigError, GraphkilnError
from graphkiln.llm import LLM
from graphkiln.models.switch_interval import lowered_switch_interval

from .app import ServerConfig, create_app

GRACEFUL_SHUTDOWN_S = 5


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket. Its protocol is named (IPPROTO_TCP) because asyncio switches Nagle's algorithm
    off (TCP_NODELAY) only on connections of such sockets: with it on, a stream's small chunks wait for the
    client's delayed acknowledgements, 40 ms each on Linux."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror}); choose another --port or --host") from e
    return sock


def serve(llm: LLM, config: ServerConfig, sock: socket.socket, log_level: str = "warning",
          switch_interval: float | None = None) -> None:
    """Run the server on `sock` (from `bind`) in this thread until it is stopped, under the interpreter's switch
    interval lowered to `switch_interval` (None: as it is); the LLM is closed after."""
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"graphkiln serve: {config.model_name!r} on http://{shown}:{port}/v1 (max context {llm.max_context} tokens)",
          file=sys.stderr, flush=True)  # fmt: skip
    if config.api_key is None and not ipaddress.ip_address(host).is_loopback:
        print(f"graphkiln serve: warning: listening on {host} without an API key; anyone who can reach it may use it",
              file=sys.stderr, flush=True)  # fmt: skip
    stopped: list[BaseException] = []

    def engine_stopped(error: BaseException) -> None:  # (the engine thread's): no request can be served any more
        stopped.append(error)
        server.should_exit = True

    app = create_app(llm, config, engine_stopped)
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
    try:
        with lowered_switch_interval(switch_interval):
            server.run(sockets=[sock])
    finally:
        sock.close()
        llm.close()
    if stopped and isinstance(stopped[0], GraphkilnError):
        raise stopped[0]
