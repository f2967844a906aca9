"""Connections at scale, friendly and hostile (issue 31): a server whose process may open only 1,024 files
holds 2,000 silent connections and 50 bodies trickled by a token holder, and still answers /health and an
authenticated chat call; the silent connections are closed within their deadline, the trickled ones within
theirs (server/connections.py)."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_harness import admin_token

pytestmark = pytest.mark.slow

SERVER = """
import sys, resource
sys.path.insert(0, "tests")
from pathlib import Path
from server_harness import Harness
from ajet_hpc.engine.model_path import resolve_model
print("limit", resource.getrlimit(resource.RLIMIT_NOFILE), flush=True)
harness = Harness("transformers", resolve_model("builtin:tiny", Path(sys.argv[1])))
server = harness.serve(header_timeout_s=3, body_timeout_s=4, keep_alive_s=3)
print("url", server.url, resource.getrlimit(resource.RLIMIT_NOFILE)[0], flush=True)
sys.stdin.read()
harness.close()
"""
SILENT, TRICKLED = 2000, 50


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True  # reset


def test_silent_and_trickling_connections_do_not_starve_health_or_chat(tmp_path: Path) -> None:
    server = subprocess.Popen(
        ["prlimit", "--nofile=1024:1024", "--", sys.executable, "-c", SERVER, str(tmp_path / "models")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    sockets: list[socket.socket] = []
    try:
        assert server.stdout is not None
        line = ""
        while not line.startswith("url "):
            line = server.stdout.readline()
            assert line, "the server did not start"
        _, url, soft_limit = line.split()
        assert int(soft_limit) == 1024  # the hard limit: nothing above it to raise to
        host, port = url.removeprefix("http://").split(":")
        token = admin_token(url)
        for _ in range(TRICKLED):  # a token holder trickling bodies
            sock = socket.create_connection((host, int(port)))
            head = f"POST /v1/episodes HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
            sock.sendall((head + "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{").encode())
            sockets.append(sock)
        trickled = list(sockets)
        opened = time.monotonic()
        for _ in range(SILENT):  # connections that never send a byte
            sockets.append(socket.create_connection((host, int(port))))
        with httpx.Client(timeout=10) as client:
            assert client.get(f"{url}/health").status_code == 200
            episode = client.post(
                f"{url}/v1/episodes", json={"task_id": "t"}, headers={"Authorization": f"Bearer {token}"}
            ).json()
            chat = client.post(
                f"{episode['base_url']}/chat/completions",
                json={"model": "policy", "messages": [{"role": "user", "content": "1+1="}], "max_tokens": 2},
                headers={"Authorization": f"Bearer {episode['api_key']}"},
            )
            assert chat.status_code == 200, chat.text
        for sock in trickled[:10]:
            # a byte now and then does not extend the body's deadline; on a loaded machine that deadline
            # may have closed the connection already, which is the outcome asserted below
            with contextlib.suppress(ConnectionResetError, BrokenPipeError):
                sock.sendall(b" ")
        deadline = opened + 3 + 4 + 10  # header, body deadlines and slack for a loaded machine
        while time.monotonic() < deadline and not all(closed_by_peer(s) for s in sockets):
            time.sleep(0.5)
        still_open = sum(not closed_by_peer(s) for s in sockets)
        assert still_open == 0, f"{still_open} of {len(sockets)} hostile connections still open"
        with httpx.Client(timeout=10) as client:
            assert client.get(f"{url}/health").status_code == 200
    finally:
        for sock in sockets:
            sock.close()
        server.communicate("", timeout=60)
    assert server.returncode == 0


def test_bad_connection_settings_are_refused_by_name() -> None:
    from ajet_hpc.config import ServingConfig

    with pytest.raises(ValueError, match="header_timeout_s"):
        ServingConfig(header_timeout_s=0)
    with pytest.raises(ValueError, match="max_connections"):
        ServingConfig.model_validate(json.loads('{"max_connections": 0}'))
