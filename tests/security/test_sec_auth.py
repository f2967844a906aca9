"""The run secret never leaves for a server that does not prove it holds it (issue 14 item 10): a planted
rendezvous file is refused, a fake server and a relay of the real one get no secret and no token, the real
server takes only run tokens from the challenge, run folders are private, and TLS works end to end."""

from __future__ import annotations

import grp
import json
import os
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from server_harness import SECRET, Harness, RunningServer
from support import topology_dict

from ajet_hpc.client import discovery
from ajet_hpc.client.handshake import ServerNotTrusted, run_client
from ajet_hpc.client.session import EpisodeAPI
from ajet_hpc.config import load_topology
from ajet_hpc.engine.model_path import resolve_model
from ajet_hpc.server.auth import mint_challenge, run_token
from ajet_hpc.storage import rendezvous
from ajet_hpc.storage.rundir import RunDir


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    harness = Harness("transformers", resolve_model("builtin:tiny", tmp_path_factory.mktemp("models")))
    yield harness
    harness.close()


@pytest.fixture(scope="module")
def server(harness: Harness) -> RunningServer:
    return harness.serve()


class Recorder(ThreadingHTTPServer):
    """An HTTP server on loopback that records every request; ``upstream``: relay each one there."""

    def __init__(self, upstream: str | None = None) -> None:
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []
        self.upstream = upstream
        super().__init__(("127.0.0.1", 0), _Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: Recorder

    def log_message(self, *args: object) -> None:
        pass

    def _answer(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.seen.append((self.command, self.path, dict(self.headers), body))
        if self.server.upstream is not None:  # a relay: the real server answers, the relay listens
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
            reply = httpx.request(
                self.command, self.server.upstream + self.path, headers=headers, content=body, timeout=30
            )
            status, content = reply.status_code, reply.content
        else:  # a planted server: answers everything, a challenge with made-up values
            status = 200
            fake = {"s": "A" * 64, "proof": "B" * 43, "episode_id": "ep-1", "status": "ok", "api_key": "x"}
            content = json.dumps(fake).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(content)))
        self.end_headers()
        self.wfile.write(content)

    do_GET = do_POST = _answer


def _leaked(recorder: Recorder) -> list[str]:
    return [
        f"{method} {path}"
        for method, path, headers, body in recorder.seen
        if "Authorization" in headers or "authorization" in headers or SECRET.encode() in body
    ]


def test_a_planted_server_gets_neither_the_secret_nor_a_token() -> None:
    planted = Recorder()
    api = EpisodeAPI(planted.url, SECRET)
    with pytest.raises(ServerNotTrusted, match="does not hold the run secret"):
        api.begin("t0", "math", {})
    assert [path.split("?")[0] for _, path, _, _ in planted.seen] == ["/v1/auth/challenge"]
    assert _leaked(planted) == []
    planted.shutdown()


def test_a_relay_of_the_real_server_gets_nothing_it_can_use(server: RunningServer) -> None:
    relay = Recorder(upstream=server.url)
    api = EpisodeAPI(relay.url, SECRET)
    with pytest.raises(ServerNotTrusted):  # the real server's proof names its own URL, not the relay's
        api.begin("t0", "math", {})
    assert len(relay.seen) == 1 and _leaked(relay) == []
    relay.shutdown()


def test_the_real_server_takes_run_tokens_and_refuses_the_secret(server: RunningServer) -> None:
    api = EpisodeAPI(server.url, SECRET)
    begun = api.begin("t0", "math", {})
    api.abort(begun["episode_id"], "test over")
    raw = httpx.get(f"{server.url}/v1/status", headers={"Authorization": f"Bearer {SECRET}"})
    assert raw.status_code == 401 and "never accepted over HTTP" in raw.json()["error"]["message"]
    other_run = EpisodeAPI(server.url, "7f" * 32)  # a client of another run: the proof does not match
    with pytest.raises(ServerNotTrusted):
        other_run.begin("t0", "math", {})


def test_an_expired_run_token_is_refused_and_the_client_proves_again(server: RunningServer) -> None:
    nonce = "n" * 32
    server_nonce, _ = mint_challenge(SECRET, nonce, server.url, now=time.time() - 2 * 24 * 3600)
    expired = run_token(SECRET, nonce, server_nonce)
    reply = httpx.get(f"{server.url}/v1/status", headers={"Authorization": f"Bearer {expired}"})
    assert reply.status_code == 401 and "expired" in reply.json()["error"]["message"]
    forged = run_token("00" * 32, nonce, server_nonce)
    reply = httpx.get(f"{server.url}/v1/status", headers={"Authorization": f"Bearer {forged}"})
    assert reply.status_code == 401
    with run_client(server.url, SECRET) as http:
        http.auth._token = expired  # type: ignore[union-attr]
        assert http.get("/v1/status").status_code == 200
        assert http.auth._token != expired  # type: ignore[union-attr]


def test_a_challenge_with_a_malformed_nonce_is_a_400(server: RunningServer) -> None:
    for nonce in ("", "short", "x" * 200, "bad chars!!!!!!!!!!!"):
        reply = httpx.get(f"{server.url}/v1/auth/challenge", params={"c": nonce})
        assert reply.status_code in (400, 422) and reply.json()["error"]["param"] in ("c", "query.c")


def planted_rendezvous(run: RunDir, url: str = "http://127.0.0.1:9") -> Path:
    path = run.rendezvous_file("policy")
    record = rendezvous.Rendezvous("policy", url, "127.0.0.1", 9, 1, "1", "node")
    rendezvous.publish(path, record)
    return path


def test_a_rendezvous_others_may_write_is_refused(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    path = planted_rendezvous(run)
    assert rendezvous.read(path) is not None  # as the run's own server writes it: 0644, ours
    path.chmod(0o664)
    with pytest.raises(rendezvous.UntrustedRendezvous, match=r"others may write it \(mode 0664\)"):
        rendezvous.read(path)
    with pytest.raises(rendezvous.UntrustedRendezvous):
        discovery.wait_for_server(run, "policy", timeout_s=5, poll_s=0.1)


def test_a_rendezvous_of_another_owner_or_a_link_is_refused(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    path = planted_rendezvous(run)
    # Another user's file needs root to make (chown); the check takes the uid to compare with instead.
    with pytest.raises(rendezvous.UntrustedRendezvous, match="not by you"):
        rendezvous.read_trusted_json(path, uid=os.getuid() + 1)
    link = run.rendezvous_file("critic")
    link.symlink_to(path)
    with pytest.raises(rendezvous.UntrustedRendezvous):
        rendezvous.read(link)


def test_run_folders_are_private_even_under_umask_002(tmp_path: Path) -> None:
    old = os.umask(0o002)
    try:
        run = RunDir.for_topology(load_topology(topology_dict(tmp_path / "run")))
        run.prepare(load_topology(topology_dict(tmp_path / "run")))
    finally:
        os.umask(old)
    for folder in (run.root, run.servers_dir, run.data_dir, run.logs_dir, run.ckpt_dir):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder


def test_a_shared_run_is_0750_and_owned_by_the_share_group(tmp_path: Path) -> None:
    group = grp.getgrgid(os.getgid()).gr_name
    topology = load_topology(topology_dict(tmp_path / "run", share_group=group))
    run = RunDir.for_topology(topology)
    run.root.mkdir(mode=0o777)
    run.root.chmod(0o777)
    run.prepare(topology)
    for folder in (run.root, run.servers_dir):
        info = folder.stat()
        assert (stat.S_IMODE(info.st_mode), info.st_gid) == (0o750, os.getgid()), folder


def test_tls_end_to_end_with_a_self_signed_certificate(
    harness: Harness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    secure = harness.serve(tls=(str(cert), str(key)))
    assert secure.url.startswith("https://")
    with pytest.raises(httpx.ConnectError):  # not trusted without the CA
        httpx.get(f"{secure.url}/health")
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # how clients are told the CA (docs/security.md)
    api = EpisodeAPI(secure.url, SECRET)
    begun = api.begin("t0", "math", {})
    assert begun["base_url"].startswith("https://")
    api.abort(begun["episode_id"], "test over")
    with pytest.raises(httpx.HTTPError):  # plain HTTP to the TLS port gets nowhere
        httpx.get(secure.url.replace("https://", "http://") + "/health", timeout=5)
