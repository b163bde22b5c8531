"""`ggx serve` from the command line: it says where it listens, takes the API key from the
environment, and refuses a port in use or a context too small before loading anything."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

from serve_helpers import request

GGX = str(Path(sys.executable).with_name("ggx"))


def test_serve_listens_where_it_says_with_the_key_from_the_environment():
    env = {**os.environ, "GGX_API_KEY": "from-env"}
    proc = subprocess.Popen([GGX, "serve", "--port", "0", "-np", "1", "-c", "256"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        m = re.search(r"on http://127\.0\.0\.1:(\d+) \(1 slots of 256 tokens, API key required\)", line)
        assert m, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = f"http://127.0.0.1:{m.group(1)}"
        assert request(url + "/health").json()["status"] == "ok"
        assert request(url + "/v1/models").status_code == 401
        r = request(url + "/v1/models", headers={"authorization": "Bearer from-env"})
        assert r.status_code == 200 and r.json()["data"][0]["id"]
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    assert proc.returncode in (0, 130)


def test_serve_refuses_a_port_in_use_and_a_context_too_small():
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        r = subprocess.run([GGX, "serve", "--port", str(port)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in r.stderr
    r = subprocess.run([GGX, "serve", "--port", "0", "-np", "4", "-c", "2"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "cannot be split among 4 slots" in r.stderr
