"""The episode API as a client runner uses it (holder of the run secret): begin, end, abort.

Its calls carry a run token from the challenge (``client/handshake.py``), never the secret: a server that
cannot prove it holds the secret raises ``ServerNotTrusted`` before anything is sent to it.

It keeps the ids of the episodes it began and has not yet ended or aborted, so that a client task that is
being stopped (SIGTERM: a cancel, or a hot swap of its group) can ``drain``: begin nothing more and abort
what is open, instead of leaving the server to wait ``episode_timeout_s`` for them.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import httpx

from ajet_hpc.client.handshake import run_client

STORE_RETRIES = 60
STORE_RETRY_S = 5.0
"""An end the server answers 503 ``store_unavailable`` (its store is full) is sent again this many times,
this far apart: a duplicate end answers once the episode is in the store."""


class ServerAway(ConnectionError):
    """The server did not answer (stopped, requeued, moved): wait for its rendezvous and try again."""


class ServerError(ServerAway):
    """The server answered, with an HTTP 5xx (a failed model call or episode call). Unlike an absent server
    it is not waited for: the runner tries the episode again a bounded number of times, then aborts it."""

    code: str | None = None  # the error's code in the server's answer (e.g. ``store_unavailable``)


class ServerGoingDown(ServerAway):
    """The server answered 503 ``engine_not_running``: its engine stopped because the server is going down
    (its job requeued, preempted or over), or is not up yet. Waited for as an absent server, after a pause
    (while it goes down it still answers ``/health``); never counted as the server failing the episode."""


GOING_DOWN_CODE = "engine_not_running"
"""The code of the server's 503 while its engine does not run (``server.errors.ENGINE_NOT_RUNNING``; the
client imports nothing of the server)."""


def going_down(status: int, code: object) -> bool:
    return status == 503 and code == GOING_DOWN_CODE


def _error_message(reply: httpx.Response) -> str:
    try:
        return str(reply.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return reply.text[:500]


def _error_code(reply: httpx.Response) -> str | None:
    try:
        return reply.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


class TrainingFinished(RuntimeError):
    """The server's training is complete: it accepts no new episodes."""


class EpisodeRejected(RuntimeError):
    """The server refused an end or abort (e.g. the episode was dropped after a timeout), saying why."""

    code: str | None = None  # the error's code in the server's answer (e.g. ``eval_round_closed``)


class EndRefused(RuntimeError):
    """The server refused an end as invalid (HTTP 400, e.g. a reward that is not finite or beyond its
    ``serving.max_abs_reward``): nothing was recorded, the episode is still open; the message says why."""


class ClientStopping(RuntimeError):
    """This client task is being stopped: it begins no new episode."""


class KeyEnded(EpisodeRejected):
    """The server already ended this (task, repeat) of the group: commit its recorded result instead."""


class EpisodeAPI:
    def __init__(self, url: str, secret: str, timeout_s: float = 600.0) -> None:
        self.url = url
        self._http = run_client(url, secret, timeout_s=timeout_s)
        self._open: set[str] = set()
        self._lock = threading.Lock()
        self._stopping: str | None = None  # the reason, once drain() was called

    def close(self) -> None:
        self._http.close()

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            reply = self._http.post(path, json=body)
        except httpx.TransportError as exc:
            raise ServerAway(f"{self.url}: {type(exc).__name__}") from exc
        if reply.status_code == 409 and "training_finished" in reply.text:
            raise TrainingFinished(reply.json()["error"]["message"])
        if reply.status_code == 409 and "episode_key_ended" in reply.text:
            raise KeyEnded(reply.json()["error"]["message"])
        if reply.status_code in (404, 409):
            rejected = EpisodeRejected(_error_message(reply))
            rejected.code = _error_code(reply)
            raise rejected
        if going_down(reply.status_code, _error_code(reply)):
            raise ServerGoingDown(f"{self.url}{path}: {_error_message(reply)}")
        if reply.status_code >= 500:
            error = ServerError(f"{self.url}{path}: HTTP {reply.status_code}: {_error_message(reply)}")
            error.code = _error_code(reply)
            raise error
        reply.raise_for_status()
        return reply.json()

    def begin(
        self, task_id: str, group: str, metadata: dict[str, Any], repeat: int | None = None
    ) -> dict[str, Any]:
        if self._stopping is not None:
            raise ClientStopping(self._stopping)
        body = {"task_id": task_id, "group": group, "repeat": repeat, "metadata": metadata}
        reply = self._post("/v1/episodes", body)
        with self._lock:
            stopping = self._stopping
            if stopping is None:
                self._open.add(reply["episode_id"])
        if stopping is not None:  # drained while this begin was on its way: do not leave it open
            with contextlib.suppress(ServerAway, EpisodeRejected):
                self.abort(reply["episode_id"], stopping)
            raise ClientStopping(stopping)
        return reply

    def end(
        self,
        episode_id: str,
        reward: float,
        turn_rewards: list[float] | None,
        metadata: dict,
        key: tuple[str, str, int] | None = None,
    ) -> dict[str, Any]:
        """End an episode; the server's summary of the episode that holds its key (``key``: (group, task,
        repeat), checked by the server): another one's, with ``duplicate``, when that key had ended."""
        body: dict[str, Any] = {"reward": reward, "turn_rewards": turn_rewards, "metadata": metadata}
        if key is not None:
            body.update(group=key[0], task_id=key[1], repeat=key[2])
        try:
            for attempt in range(1, STORE_RETRIES + 1):
                try:
                    return self._post(f"/v1/episodes/{episode_id}/end", body)
                except ServerError as exc:
                    # The episode ended, but the server's store did not take it yet (a full disk): the
                    # same end again answers once it is stored; past the retries, the caller's 5xx path.
                    if exc.code != "store_unavailable" or attempt == STORE_RETRIES:
                        raise
                    time.sleep(STORE_RETRY_S)
            raise AssertionError("unreachable")
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code == 400:
                raise EndRefused(f"end of {episode_id} refused: {_error_message(exc.response)}") from exc
            raise
        finally:
            self._forget(episode_id)

    def ended(self, group: str) -> dict[tuple[str, int], dict[str, Any]]:
        """(task id, repeat) -> recorded result (episode_id, reward, ended_at) of every key of ``group`` the
        server has ended."""
        try:
            reply = self._http.get("/v1/episodes/ended", params={"group": group})
        except httpx.TransportError as exc:
            raise ServerAway(f"{self.url}: {type(exc).__name__}") from exc
        if reply.status_code >= 500:
            raise ServerAway(f"{self.url}: HTTP {reply.status_code}")
        reply.raise_for_status()
        return {(e["task_id"], e["repeat"]): e for e in reply.json()["ended"]}

    def eval_round(self, group: str, index: int) -> dict[str, Any]:
        """The server's answer to which eval round array task ``index`` of eval group ``group`` has to run
        (``step``, or None after a wait of up to ``ROUND_POLL_S``; ``finished`` once training is over)."""
        try:
            reply = self._http.get("/v1/eval/round", params={"group": group, "index": index})
        except httpx.TransportError as exc:
            raise ServerAway(f"{self.url}: {type(exc).__name__}") from exc
        if reply.status_code >= 500:
            raise ServerAway(f"{self.url}: HTTP {reply.status_code}")
        if reply.status_code >= 400:
            raise EpisodeRejected(f"eval round of {group}: {_error_message(reply)}")
        return reply.json()

    def eval_done(self, group: str, index: int, step: int, episodes: int) -> bool:
        """Report that this task ran its share of the round at ``step``; False when it was closed already."""
        body = {"group": group, "index": index, "step": step, "episodes": episodes}
        return bool(self._post("/v1/eval/done", body)["accepted"])

    def abort(self, episode_id: str, reason: str) -> None:
        try:
            self._post(f"/v1/episodes/{episode_id}/abort", {"reason": reason[-2000:]})
        finally:
            self._forget(episode_id)

    def _forget(self, episode_id: str) -> None:
        with self._lock:
            self._open.discard(episode_id)

    def drain(self, reason: str) -> int:
        """Begin no new episode and abort every open one with ``reason``; returns how many were aborted."""
        with self._lock:
            self._stopping = reason
            still_open = sorted(self._open)
        aborted = 0
        for episode_id in still_open:
            try:
                self.abort(episode_id, reason)
                aborted += 1
            except (ServerAway, EpisodeRejected):  # already closed (ended meanwhile), or the server is gone
                continue
        return aborted
