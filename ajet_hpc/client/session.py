"""The episode API as a client runner uses it (holder of the run secret): begin, end, abort."""

from __future__ import annotations

from typing import Any

import httpx


class ServerAway(ConnectionError):
    """The server did not answer (stopped, requeued, moved): wait for its rendezvous and try again."""


class TrainingFinished(RuntimeError):
    """The server's training is complete: it accepts no new episodes."""


class EpisodeRejected(RuntimeError):
    """The server refused an end or abort (e.g. the episode was dropped after a timeout), saying why."""


class EpisodeAPI:
    def __init__(self, url: str, secret: str, timeout_s: float = 600.0) -> None:
        self.url = url
        self._http = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {secret}"}, timeout=timeout_s
        )

    def close(self) -> None:
        self._http.close()

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            reply = self._http.post(path, json=body)
        except httpx.TransportError as exc:
            raise ServerAway(f"{self.url}: {type(exc).__name__}") from exc
        if reply.status_code == 409 and "training_finished" in reply.text:
            raise TrainingFinished(reply.json()["error"]["message"])
        if reply.status_code in (404, 409):
            raise EpisodeRejected(reply.json().get("error", {}).get("message", reply.text))
        if reply.status_code >= 500:
            raise ServerAway(f"{self.url}: HTTP {reply.status_code}")
        reply.raise_for_status()
        return reply.json()

    def begin(self, task_id: str, group: str, metadata: dict[str, Any]) -> dict[str, Any]:
        return self._post("/v1/episodes", {"task_id": task_id, "group": group, "metadata": metadata})

    def end(self, episode_id: str, reward: float, turn_rewards: list[float] | None, metadata: dict) -> None:
        body = {"reward": reward, "turn_rewards": turn_rewards, "metadata": metadata}
        self._post(f"/v1/episodes/{episode_id}/end", body)

    def abort(self, episode_id: str, reason: str) -> None:
        self._post(f"/v1/episodes/{episode_id}/abort", {"reason": reason[-2000:]})
