"""A client task whose call to its server failed, while the server goes on answering at the same URL (a
transient transport error under load): the task keeps its episode API, so that the other episodes' calls in
flight on it are not cut (found by tools/bench/scale.py: at 4,096 open episodes, each failed call replaced
the task's API and closed it under 63 other episodes' calls, which then failed in turn). A server at a new
URL (requeued elsewhere) still gets a new API. Real server (transformers engine, tiny model), real HTTP,
real run dir."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from server_harness import SECRET, Harness
from support import topology_dict

from ajet_hpc.client import discovery, runner
from ajet_hpc.config import load_topology
from ajet_hpc.engine.model_path import resolve_model
from ajet_hpc.storage import rendezvous
from ajet_hpc.storage.rundir import RunDir


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory):
    harness = Harness("transformers", resolve_model("builtin:tiny", tmp_path_factory.mktemp("model")))
    yield harness
    harness.close()


def publish(run: RunDir, url: str) -> None:
    port = int(url.rsplit(":", 1)[1])
    record = rendezvous.Rendezvous("policy", url, "127.0.0.1", port, os.getpid(), "local", "here", "serving")
    rendezvous.publish(run.rendezvous_file("policy"), record)


def test_a_failed_call_keeps_the_api_while_the_server_answers_at_its_url(
    tmp_path: Path, harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    topology = load_topology(topology_dict(tmp_path / "run"))
    run = RunDir.for_topology(topology)
    run.prepare(topology)
    run.secret_file.write_text(SECRET)
    first, second = harness.serve(), harness.serve()
    publish(run, first.url)
    task = runner.GroupTask(run, topology.clients[0], 0, repeats=1)
    probes: list[str] = []
    real_probe = discovery.probe

    def counted(record: rendezvous.Rendezvous, timeout_s: float = 5.0) -> dict[str, object] | None:
        probes.append(record.url)  # which server was asked: the real /health call follows
        return real_probe(record, timeout_s)

    monkeypatch.setattr(discovery, "probe", counted)
    try:
        api = task.connect("policy")
        assert api.url == first.url and probes == [first.url]
        calls: list[object] = []

        def call_in_flight() -> None:  # another episode's call on the same API
            for _ in range(20):
                calls.append(api.ended(topology.clients[0].name))

        other = threading.Thread(target=call_in_flight)
        other.start()
        again = task.connect("policy", known_url=api.url)  # a call failed: the server is asked again
        other.join(30)
        assert again is api and len(calls) == 20  # kept, and the other episode's calls all answered
        assert probes == [first.url, first.url]
        publish(run, second.url)  # the server moved: a new API
        moved = task.connect("policy", known_url=api.url)
        assert moved is not api and moved.url == second.url
        assert moved.ended(topology.clients[0].name) == {}
    finally:
        task.store.close()
