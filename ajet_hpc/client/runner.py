"""One client array task: find the group's servers, then run its share of the tasks as episodes.

Each episode: begin (one episode per server the group uses) → the agent, given base_url and episode token
→ end with the reward (abort with the traceback when the agent raises). Up to ``in_flight`` episodes run
at once, in threads (agents are plain blocking functions). When a server goes away mid-episode, the task
waits for the server's rendezvous (it may come back on another node) and runs the episode again.

A (task, repeat) committed in any store of the group (every index, also those of an earlier array size)
is not run again. Neither is one the servers already ended (the task died between the server's answer to
``end`` and its own commit, or the answer was lost): the task asks its servers which keys of its group
ended (``GET /v1/episodes/ended``), at its start and whenever a server comes back, and commits their
recorded results instead; a server also refuses to begin an ended key and answers a second end of one
with the first one's result.

On SIGTERM (a cancel, or a hot swap of the group) the task begins no new episode, aborts its open ones
with a reason, closes its store and exits (the process around the task, its signal handler and exit code:
``client/runner_process.py``).

A server that answers a call of the episode with an HTTP 5xx (the agent's model call, or begin/end) is not
away: the episode is aborted there with the error as its reason and run again after a pause, at most
``SERVER_ERROR_ATTEMPTS`` times in all (pauses of ``SERVER_ERROR_BACKOFF_S``, doubling); then the task and
repeat are given up (aborted, counted, logged with the last error) and the runner goes on with the others.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import traceback
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ajet_hpc import fault_injection
from ajet_hpc.client.discovery import ServerFinished, ServerGone, WaitStopped, wait_for_server
from ajet_hpc.client.handshake import ServerNotTrusted
from ajet_hpc.client.session import (
    ClientStopping,
    EndRefused,
    EpisodeAPI,
    EpisodeRejected,
    KeyEnded,
    ServerAway,
    ServerError,
    ServerGoingDown,
    TrainingFinished,
    going_down,
)
from ajet_hpc.client.task_sources import assigned_tasks
from ajet_hpc.config import ClientGroupConfig, Topology
from ajet_hpc.environments.episode import EpisodeContext, ModelHandle, Outcome, Task, as_outcome
from ajet_hpc.environments.sources import import_entry
from ajet_hpc.storage.client_store import (
    ClientStore,
    CommitFailed,
    Result,
    StoreCorrupt,
    read_results,
    unstorable_reason,
)
from ajet_hpc.storage.h5_layout import StoreError
from ajet_hpc.storage.lease import LeaseLost
from ajet_hpc.storage.rundir import RunDir

log = logging.getLogger(__name__)

SERVER_ERROR_ATTEMPTS = 4
"""Runs of an episode that a server answers with a 5xx before its task and repeat are given up."""
SERVER_ERROR_BACKOFF_S = 2.0
"""Pause before the second run after a 5xx; doubled before each next one (2, 4, 8 s by default)."""


@dataclass
class Tally:
    finished: int = 0
    aborted: int = 0
    recovered: int = 0  # committed from a server's recorded result, not run again
    rewards: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class GroupTask:
    """The episodes of one array task of a client group."""

    gone: ServerGone | None = None  # a server failed or stayed away too long: the task stops
    server_error_attempts = SERVER_ERROR_ATTEMPTS
    server_error_backoff_s = SERVER_ERROR_BACKOFF_S
    store_failed: StoreError | CommitFailed | None = None  # a commit failed: the task stops

    def __init__(self, run: RunDir, group: ClientGroupConfig, index: int, repeats: int) -> None:
        self.rundir, self.group, self.index, self.repeats = run, group, index, repeats
        self.agent = import_entry(group.agent)
        self.secret = run.read_secret()
        self.apis: dict[str, EpisodeAPI] = {}
        self.apis_lock = threading.Lock()
        self.finished = threading.Event()  # a server's training is complete: start no new episode
        self.started = threading.Event()  # episodes have begun to run (set before the first one)
        self.stopping = threading.Event()  # SIGTERM: drain and leave
        self.tally = Tally()
        self.ended: dict[str, dict[tuple[str, int], dict]] = {}  # server -> keys it ended, with results
        self.ends = 0  # episodes ended at every server (the test hook counts them)
        self.episode_meta: dict[str, object] = {}  # sent with every begin (an eval round's step)
        self.halted = threading.Event()  # the tasks being run are over (an eval round closed): run no more
        store_path = run.client_store(group.name, index)
        store_path.parent.mkdir(parents=True, exist_ok=True)
        self.store = ClientStore.open(store_path, group=group.name, index=index)

    def connect(self, name: str, known_url: str | None = None) -> EpisodeAPI:
        """The episode API of server ``name``, waiting for it (again) when it is away.

        ``known_url``: a call to the server there failed. The API is replaced only when the server moved
        (a new URL); found answering at the same URL (a transient failure, or a restart on the same node),
        the same API goes on: closing it would cut every other episode's call in flight on it, each of which
        would then wait for the server in turn."""
        with self.apis_lock:
            api = self.apis.get(name)
            if api is not None and api.url != known_url:
                return api
            try:
                found = wait_for_server(
                    self.rundir, name, timeout_s=self.group.server_wait_s, stop=self.stopping
                )
            except WaitStopped as exc:  # SIGTERM while the server is away: no episode waits for it
                self.finished.set()
                raise ClientStopping(str(exc)) from exc
            except (ServerFinished, ServerGone) as exc:  # start no new episode, wherever this was asked
                self.gone = exc if isinstance(exc, ServerGone) else None
                self.finished.set()
                raise
            if api is not None and api.url == found.url:
                log.info("server %s answers at %s", name, found.url)
                return api
            if api is not None:
                api.close()
                log.info("server %s is back at %s", name, found.url)
            else:
                log.info(
                    "client %s[%d] reached server %s at %s (job %s on %s)",
                    self.group.name,
                    self.index,
                    name,
                    found.url,
                    found.rendezvous.job_id,
                    found.rendezvous.node,
                )
            self.apis[name] = EpisodeAPI(found.url, self.secret)
            return self.apis[name]

    def run(self) -> Tally:
        try:
            for name in self.group.servers:
                self.connect(name)
        except ServerFinished as exc:
            log.info("nothing to do: %s", exc)
            return self.tally
        except ServerGone:
            return self.tally
        return self.run_tasks(assigned_tasks(self.group, self.index, base_dir=self.rundir.root.parent))

    def run_tasks(self, tasks: Iterable[Task]) -> Tally:
        """Run ``repeats`` episodes of each task (the servers reached), skipping the (task, repeat) pairs
        committed in the group's stores or ended at the servers; returns when all have ended."""
        done = self.store.committed()
        elsewhere: set[tuple[str, int]] = set()
        if resharded(self.rundir, self.group):  # else only this index's store holds keys of its shard
            elsewhere = committed_in_group(self.rundir, self.group.name, mine=self.store.path) - done
        if done or elsewhere:
            log.info(
                "resuming: %d results already committed in %s, %d by other tasks of group %s",
                len(done),
                self.store.path,
                len(elsewhere),
                self.group.name,
            )
        done |= elsewhere
        try:
            self.refresh_ended()
        except (ServerFinished, ServerGone) as exc:
            log.info("nothing to do: %s", exc)
            return self.tally
        except ServerNotTrusted as exc:
            self.stop_untrusted(exc)
            return self.tally
        slots = threading.BoundedSemaphore(self.group.in_flight)
        self.started.set()
        with ThreadPoolExecutor(self.group.in_flight, thread_name_prefix="episode") as pool:
            for task in tasks:
                for repeat in range(self.repeats):
                    try:
                        if (task.id, repeat) in done or self.commit_recorded(task, repeat):
                            continue
                    except (CommitFailed, LeaseLost) as exc:
                        self.stop_on_store_failure(exc)
                        break
                    slots.acquire()
                    if self.finished.is_set() or self.halted.is_set():
                        slots.release()
                        break
                    future = pool.submit(self.episode, task, repeat)
                    future.add_done_callback(lambda _: slots.release())
                if self.finished.is_set() or self.halted.is_set():
                    break
        return self.tally

    def episode(self, task: Task, repeat: int) -> None:
        """Run one episode to its end, again from the start each time a server goes away or drops it
        (unless the servers ended it meanwhile: then their recorded result is committed)."""
        rejected = server_errors = 0
        retry = False
        while not (self.finished.is_set() or self.halted.is_set()):
            try:
                if retry:
                    self.refresh_ended()
                    if self.commit_recorded(task, repeat):
                        return
                retry = True
                self._attempt(task, repeat)
                return
            except (CommitFailed, LeaseLost) as exc:
                self.stop_on_store_failure(exc)
                return
            except KeyEnded as exc:
                self.refresh_ended()
                if not self.commit_recorded(task, repeat):
                    log.error(
                        "task %s repeat %d: %s, but not at every server of the group", task.id, repeat, exc
                    )
                return
            except EpisodeRejected as exc:
                rejected += 1
                log.warning(
                    "task %s repeat %d not accepted (%s): try %d of 3", task.id, repeat, exc, rejected
                )
                if rejected >= 3:
                    return
            except (TrainingFinished, ServerFinished, ClientStopping) as exc:
                log.info("stopping: %s", exc)
                self.finished.set()
            except ServerError as exc:
                server_errors += 1
                if server_errors >= self.server_error_attempts:
                    log.error(
                        "task %s repeat %d aborted: a server answered with an error %d time(s) in a row; "
                        "last: %s",
                        task.id,
                        repeat,
                        server_errors,
                        exc,
                    )
                    with self.tally.lock:
                        self.tally.aborted += 1
                    return
                pause = self.server_error_backoff_s * 2 ** (server_errors - 1)
                log.warning(
                    "task %s repeat %d: %s; running it again in %.1f s (attempt %d of %d)",
                    task.id,
                    repeat,
                    exc,
                    pause,
                    server_errors + 1,
                    self.server_error_attempts,
                )
                self.finished.wait(pause)
            except ServerNotTrusted as exc:  # a planted rendezvous file, or another run's server
                self.stop_untrusted(exc)
                return
            except ServerAway as exc:
                if self.stopping.is_set():  # the server went with the cancel that stops this task
                    log.info("task %s repeat %d stopped with the runner (%s)", task.id, repeat, exc)
                    return
                log.warning(
                    "task %s repeat %d: server away (%s); waiting to run it again", task.id, repeat, exc
                )
                if isinstance(exc, ServerGoingDown):  # it still answers /health while it goes down
                    self.finished.wait(self.server_error_backoff_s)
                try:
                    for name, api in list(self.apis.items()):
                        self.connect(name, known_url=api.url)
                except ClientStopping as stopped:
                    log.info("task %s repeat %d: %s", task.id, repeat, stopped)
                    return
            except Exception:
                log.exception("task %s repeat %d failed", task.id, repeat)
                return

    def stop_untrusted(self, exc: ServerNotTrusted) -> None:
        """A server did not prove that it holds the run secret: nothing was sent to it; the task stops
        (``EXIT_SERVER_GONE``) rather than try it again for every episode."""
        if self.gone is None:
            self.gone = ServerGone(str(exc))
            log.error("client %s[%d]: %s; running no more episodes", self.group.name, self.index, exc)
        self.finished.set()

    def stop_on_store_failure(self, exc: CommitFailed | LeaseLost) -> None:
        """A result could not be committed: begin no new episode (none could be recorded)."""
        if self.store_failed is None:
            self.store_failed = exc
            log.error("client %s[%d]: %s; running no more episodes", self.group.name, self.index, exc)
        self.finished.set()

    def refresh_ended(self) -> None:
        """Ask every server of the group which of the group's keys it ended (waiting for absent ones)."""
        for name in self.group.servers:
            while True:
                api = self.connect(name)
                try:
                    self.ended[name] = api.ended(self.group.name)
                    break
                except ServerAway as exc:
                    log.warning("server %s away while asked for its ended episodes (%s)", name, exc)
                    self.connect(name, known_url=api.url)

    def commit_recorded(self, task: Task, repeat: int) -> bool:
        """Commit the result the servers recorded for (task, repeat), when every one of them ended it."""
        found: dict[str, dict] = {}
        for name in self.group.servers:
            info = self.ended.get(name, {}).get((task.id, repeat))
            if info is None:
                return False
            found[name] = info
        first = found[self.group.servers[0]]
        self.store.commit(
            Result(
                task_id=task.id,
                repeat=repeat,
                reward=float(first["reward"] or 0.0),
                rewards={name: float(info["reward"] or 0.0) for name, info in found.items()},
                episode_ids={name: info["episode_id"] for name, info in found.items()},
                transcript=None,
                metadata={"recovered": True},
                finished_at=max(float(info["ended_at"]) for info in found.values()),
            )
        )
        log.info(
            "task %s repeat %d ended at the server(s) before (episode %s): committed, not run again",
            task.id,
            repeat,
            first["episode_id"],
        )
        with self.tally.lock:
            self.tally.recovered += 1
        return True

    def _attempt(self, task: Task, repeat: int) -> None:
        """One run of an episode: begin it at every server, run the agent, end it with the rewards, commit."""
        begun = self._begin(task, repeat)
        outcome = self._run_agent(task, repeat, begun)
        if outcome is None:
            return
        ended = self._end(task, repeat, begun, outcome)
        if ended is None:
            return
        _test_exit_after_end(self)
        self._commit_ended(task, repeat, begun, ended, outcome)

    def _begin(self, task: Task, repeat: int) -> dict[str, dict]:
        """Begin the episode at every server of the group; on a failure, abort it where it did begin."""
        meta = {**self.episode_meta, "repeat": repeat, "client": self.index, "agent": self.group.agent}
        begun: dict[str, dict] = {}
        try:
            for name in self.group.servers:
                begun[name] = self.connect(name).begin(task.id, self.group.name, meta, repeat)
        except Exception as exc:  # refused, finished or away: the servers that did begin it are not left open
            for name, b in begun.items():  # (a co-trained model whose training ended refuses new episodes)
                self._abort_quietly(name, b["episode_id"], f"{type(exc).__name__}: {exc}")
            raise
        return begun

    def _run_agent(self, task: Task, repeat: int, begun: dict[str, dict]) -> Outcome | None:
        """The agent's outcome of the episode; None when the agent failed (the episode is aborted and
        counted). A failure of a server under the agent is raised as ``ServerAway`` or ``ServerError``."""
        handles = {name: ModelHandle(name, b["base_url"], b["api_key"]) for name, b in begun.items()}
        try:
            outcome = as_outcome(self.agent(EpisodeContext(task=task, models=handles, repeat=repeat)))
            outcome.check_models(begun)
            ids = {name: b["episode_id"] for name, b in begun.items()}
            unstorable = unstorable_reason(self._result(task, repeat, outcome, ids))
            if unstorable is not None:  # abort now, rather than fail the commit after the end
                raise ValueError(f"the agent's outcome cannot be stored: {unstorable}")
        except Exception as exc:
            failure = _server_failure(exc)
            if isinstance(failure, ServerError | ServerGoingDown):  # it answered: abort there, saying why
                for name, b in begun.items():
                    self._abort_quietly(name, b["episode_id"], str(failure))
            if failure is not None:
                raise failure from exc
            if self.stopping.is_set():  # its episodes were aborted under it by the drain: not its fault
                log.info("task %s repeat %d stopped with the runner (%s)", task.id, repeat, exc)
                with self.tally.lock:
                    self.tally.aborted += 1
                return None
            reason = "".join(traceback.format_exception(exc))
            log.warning("agent failed on task %s repeat %d:\n%s", task.id, repeat, reason)
            for name, b in begun.items():
                self._abort_quietly(name, b["episode_id"], reason)
            with self.tally.lock:
                self.tally.aborted += 1
            return None
        return outcome

    def _end(
        self, task: Task, repeat: int, begun: dict[str, dict], outcome: Outcome
    ) -> dict[str, dict] | None:
        """End the episode at every server, each model's with its own reward: the servers' answers; None
        when a server refused the end (the episode is aborted and counted)."""
        key = (self.group.name, task.id, repeat)
        try:
            return {  # each model's episode ends with that model's own reward
                name: self.connect(name).end(
                    b["episode_id"],
                    outcome.reward_for(name),
                    outcome.turn_rewards_for(name),
                    outcome.metadata,
                    key=key,
                )
                for name, b in begun.items()
            }
        except EndRefused as exc:  # e.g. a reward beyond serving.max_abs_reward: abort, do not leave it open
            log.error("task %s repeat %d: %s; its episode(s) are aborted", task.id, repeat, exc)
            for name, b in begun.items():
                self._abort_quietly(name, b["episode_id"], str(exc))
            with self.tally.lock:
                self.tally.aborted += 1
            return None

    def _commit_ended(
        self, task: Task, repeat: int, begun: dict[str, dict], ended: dict[str, dict], outcome: Outcome
    ) -> None:
        """Commit the ended episode's result, with the rewards the servers confirmed; a server that had
        ended this key before (an earlier run) answered with that result, which is the one committed."""
        duplicate = [
            name
            for name, e in ended.items()
            if e.get("duplicate") and e["episode_id"] != begun[name]["episode_id"]
        ]
        if duplicate:  # a server had this key from an earlier run: its result is the one that counts
            log.warning(
                "task %s repeat %d had ended before at %s: committing that result", task.id, repeat, duplicate
            )
        first = ended[self.group.servers[0]]
        ids = {name: e["episode_id"] for name, e in ended.items()}
        if duplicate:
            self.store.commit(
                Result(
                    task_id=task.id,
                    repeat=repeat,
                    reward=float(first["reward"]),
                    rewards={name: float(e["reward"]) for name, e in ended.items()},
                    episode_ids=ids,
                    transcript=None,
                    metadata={**outcome.metadata, "recovered": True},
                    finished_at=time.time(),
                )
            )
        else:
            result = self._result(task, repeat, outcome, ids)
            result.rewards.update({name: float(e["reward"]) for name, e in ended.items()})
            self.store.commit(result)
        with self.tally.lock:
            self.tally.finished += 1
            self.tally.rewards.append(outcome.reward)

    @staticmethod
    def _result(task: Task, repeat: int, outcome: Outcome, episode_ids: dict[str, str]) -> Result:
        """The result an episode commits: its rewards are the ones the servers confirm at the end."""
        return Result(
            task_id=task.id,
            repeat=repeat,
            reward=outcome.reward,
            rewards={name: outcome.reward_for(name) for name in episode_ids},
            episode_ids=episode_ids,
            transcript=None if outcome.transcript is None else json.dumps(outcome.transcript, default=str),
            metadata=outcome.metadata,
            finished_at=time.time(),
        )

    def stop(self, reason: str) -> None:
        """Begin no new episode and abort the open ones, so that the servers need not time them out."""
        self.finished.set()
        aborted = sum(api.drain(reason) for api in list(self.apis.values()))
        log.info("stopping: %s; %d open episode(s) aborted", reason, aborted)

    def _abort_quietly(self, server: str, episode_id: str, reason: str) -> None:
        try:
            self.connect(server).abort(episode_id, reason)
        except Exception as exc:  # best effort: the server times an episode out otherwise
            log.info("abort of %s not delivered: %s: %s", episode_id, type(exc).__name__, exc)


def _test_exit_after_end(task: GroupTask) -> None:
    """The hook `fault_injection.EXIT_AFTER_END` (chaos tests only)."""
    wanted = fault_injection.armed(fault_injection.EXIT_AFTER_END)
    if not wanted:
        return
    with task.tally.lock:
        task.ends += 1
        count = task.ends
    marker = task.rundir.root / f".test-exit-after-end-{task.group.name}-{task.index}"
    if count == int(wanted) and not marker.exists():
        marker.touch()
        log.warning("test hook %s: exiting between end and commit", fault_injection.EXIT_AFTER_END)
        logging.shutdown()
        os._exit(137)


def _server_failure(exc: BaseException) -> ServerAway | None:
    """Whether an agent's model call failed because of the server (openai / httpx): ``ServerAway`` when it
    could not be reached, ``ServerGoingDown`` when it answered that its engine does not run (it is going
    down), ``ServerError`` (with the server's message) when it answered another 5xx; else None."""
    import httpx
    import openai

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, openai.APIConnectionError | httpx.TransportError):
            return ServerAway(str(seen))
        if isinstance(seen, openai.APIStatusError) and going_down(seen.status_code, seen.code):
            return ServerGoingDown(f"the agent's model call got HTTP 503: {seen.message}")
        if isinstance(seen, openai.APIStatusError) and seen.status_code >= 500:
            return ServerError(f"the agent's model call got HTTP {seen.status_code}: {seen.message}")
        seen = seen.__cause__ or seen.__context__
    return None


SHARDING_FIELDS = ("array", "tasks", "max_tasks", "epochs")
"""What decides which tasks an array index runs (`task_sources.assigned_tasks`)."""


def resharded(run: RunDir, group: ClientGroupConfig) -> bool:
    """Whether an earlier topology of the run split ``group``'s tasks over its indices otherwise (a hot swap
    or a forced relaunch changed its array size or its tasks): then keys of this index's shard may be
    committed in other stores. Without that, a task opens no store but its own: at the start of a large
    array, every task reading every other's store would cost the file system tasks² opens. An earlier
    topology that cannot be read counts as resharded (the safe side)."""
    now = {name: getattr(group, name) for name in SHARDING_FIELDS}
    for path in run.earlier_topologies():
        try:
            clients = (yaml.safe_load(path.read_text()) or {}).get("clients") or []
            before = next((c for c in clients if c.get("name") == group.name), None)
        except (OSError, yaml.YAMLError, AttributeError) as exc:
            log.warning("cannot read %s (%s): reading every store of group %s", path, exc, group.name)
            return True
        if before is not None and any(before.get(name) != value for name, value in now.items()):
            return True
    return False


def committed_in_group(run: RunDir, group: str, mine: Path) -> set[tuple[str, int]]:
    """The (task, repeat) pairs committed in the group's stores other than ``mine``: every index, also the
    indices of an earlier, larger array, whose sharding differed (a hot swap can change the size)."""
    folder = run.client_store_dir(group)
    stores = [*folder.glob("*.h5"), *folder.glob("*.h5.journal")]  # not the stores' .lease files
    paths = {Path(str(p).removesuffix(".journal")) for p in stores} - {mine}
    found: set[tuple[str, int]] = set()
    for path in sorted(paths):
        try:
            found.update(result.key for result in read_results(path))
        except (StoreCorrupt, OSError) as exc:
            log.warning("cannot read %s (%s): the results committed there may run again", path, exc)
    return found


def group_task(run: RunDir, topology: Topology, group: ClientGroupConfig, index: int) -> GroupTask:
    """The worker of a training group's array task."""
    return GroupTask(run, group, index, topology.episode_repeats(group))
