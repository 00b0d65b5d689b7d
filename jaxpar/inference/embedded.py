"""``jaxpar serve``'s app inside the calling process: uvicorn on a thread of its own.

    with running(service, limits) as port:
        ... # speak HTTP to 127.0.0.1:port; reach into service.workers meanwhile

For tests, notebooks and benchmarks that want the server and its engines in one process (the command
line runs uvicorn on the main thread instead, with signal handling: ``jaxpar.inference.serve_command``).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn

from jaxpar.inference.server import Service, build_app


@contextlib.contextmanager
def running(service: Service, *, host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float = 2.0):
    """Serves ``service`` on ``host:port`` (0: a free port) until the block ends; yields the port."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.bind((host, port))
    config = uvicorn.Config(
        build_app(service),
        log_level="warning",
        limit_concurrency=service.limits.max_connections,
        timeout_graceful_shutdown=shutdown_timeout,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server stopped before it started")
        time.sleep(0.02)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(shutdown_timeout + 30)
