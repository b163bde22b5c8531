"""Starting a `ggx serve` app in this process on 127.0.0.1 with a free port (uvicorn in a thread)."""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import uvicorn

from ggx.models.batched import Batcher
from ggx.serve.app import ServeConfig, create_app
from ggx.serve.engine import Engine

N_SLOTS = 2
CTX_PER_SLOT = 512
MAX_BODY = 64 * 1024
MAX_QUEUE = 1


@dataclass
class Server:
    url: str
    engine: Engine
    model: object


def start_server(model, api_key: str | None = None, max_queue: int = MAX_QUEUE) -> tuple[Server, Callable[[], None]]:
    batcher = Batcher(model, N_SLOTS, N_SLOTS * CTX_PER_SLOT, n_chunk=64, decode_rows=N_SLOTS)
    batcher.warmup()
    engine = Engine(batcher, max_queue)
    app = create_app(model, engine, ServeConfig("smollm2", api_key, MAX_BODY))
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()

    return Server(f"http://127.0.0.1:{port}", engine, model), stop


@dataclass
class Reply:
    """An HTTP answer read with the standard library (no HTTP client package assumed)."""

    status_code: int
    headers: dict[str, str]
    text: str

    def json(self):
        return json.loads(self.text)


def request(url: str, method: str = "GET", content: bytes | str | None = None,
            headers: dict[str, str] | None = None, timeout: float = 60) -> Reply:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        body = content.encode() if isinstance(content, str) else content
        hdrs = {"content-type": "application/json"} if body is not None else {}
        conn.request(method, parts.path, body=body, headers={**hdrs, **(headers or {})})
        r = conn.getresponse()
        return Reply(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode("utf-8", "replace"))
    finally:
        conn.close()


class Stream:
    """A streaming POST left open: `lines(n)` reads n lines of its body, `close()` hangs up."""

    def __init__(self, url: str, body: dict, timeout: float = 60):
        parts = urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
        self.conn.request("POST", parts.path, body=json.dumps(body), headers={"content-type": "application/json"})
        self.response = self.conn.getresponse()
        self.status_code = self.response.status

    def lines(self, n: int) -> list[str]:
        return [self.response.readline().decode().rstrip("\n") for _ in range(n)]

    def close(self) -> None:
        self.conn.sock and self.conn.sock.close()  # hang up at once, mid-stream
        self.conn.close()
