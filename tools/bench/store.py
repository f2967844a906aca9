#!/usr/bin/env python
"""Benchmark of the server store: ``python tools/bench/store.py [--quick] [--repeats R] [--episodes N]``.

Writes N synthetic multi-turn episodes (default 100k; ``--quick``: 20k) to the server store
(``EpisodeWriter``) and, in a second process with the same episodes, to JSONL (one JSON object per
episode: the record's fields and each timeline as ``Timeline.to_dict`` gives it). Each episode is an agent
of 5 turns: a 300-token system prompt (one of 8), a 40-token user task, then per turn a 60-token answer
(a tool call) and a 120-token tool output, the last answer final; chat-template scaffolding around every
message; token ids from a 50k vocabulary with Zipf frequencies, each id a word so that the messages' text
matches the tokens. Timeline k holds the whole prompt so far (about 3.8k tokens per episode).

Prints the size ratio JSONL/HDF5, the append rate (episodes per second of time spent inside
``append_episode``, i.e. what the server's recorder thread pays) with its per-episode median and p99, and
the latency of reading one episode by id (median of 200 random ids, with a reader opened fresh, the file
in the page cache) at 10k episodes (``--quick``: 10k) while the writer still appends, and at the end.
Group commit (the server's recorder, ``EpisodeRecorder``): groups of 64 such episodes submitted together
(as when many agents end at once), each group waited for with ``flush``; episodes per second from the first
submit to the last flush (``write_eps_group``), and the fsyncs of the store per episode, counted by the
writer itself (``fsyncs_per_episode``), and this process's CPU time per episode in the same spans, every
thread (``cpu_ms_group``: what the work costs, much less moved by other jobs than the rate). The same
episodes submitted one at a time, each waited for (every episode its own commit, as before group commit),
in the same run for the ratio.

The client store's group commits (``ClientStore``, one per array task): a busy task, 4 episodes in flight
committing 10 results a second between them for 10 s (``--smoke``: 3 s), its journal's fsyncs counted at
``os.fsync`` (``fsyncs_per_episode_client``; one per result before group commits). Ends with one line::

    RESULT size_ratio=<jsonl/hdf5> write_eps=<episodes/s> read_ms_10k=<ms> read_ms_100k=<ms>
           write_eps_group=<episodes/s> write_eps_group_min=<episodes/s> write_eps_group_max=<episodes/s>
           cpu_ms_group=<ms> fsyncs_per_episode=<n> fsyncs_per_episode_client=<n> repeats=<n>

Repeats: the short measurements (appends of small episodes, group commit and one at a time, the client
store) run ``--repeats`` times (default 5; ``--smoke``: 2), each on fresh files, and the reads by id at the
end as many times (a fresh reader and 200 new random ids each); each figure is printed as the median of its
repeats with their minimum and maximum, and the ``RESULT`` keys are medians (``write_eps_group_min`` and
``_max`` give the spread of the group rate, ``repeats`` their number). The long run (N episodes: the sizes,
``write_eps``, the read at 10k while the writer appends) runs once: ``write_eps`` is one rate over N
appends. A single run's figures move by ±30 % and more on a shared machine; compare code side by side, in
alternating runs, by the ratio. The output starts with the date, the git commit of this checkout (and any
files changed from it) and the load average, and ends with the load average again.

Everything is written under a temporary folder (or ``--dir``) and removed at the end.
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ajet_hpc.server.recorder import EpisodeRecorder  # noqa: E402
from ajet_hpc.storage.client_store import ClientStore  # noqa: E402
from ajet_hpc.storage.client_store import Result as ClientResult  # noqa: E402
from ajet_hpc.storage.episode_store_reader import EpisodeReader  # noqa: E402
from ajet_hpc.storage.episode_store_writer import EpisodeWriter  # noqa: E402
from ajet_hpc.storage.records import EpisodeRecord  # noqa: E402
from ajet_hpc.tracking.timeline import MODEL, SYSTEM, TOOL, USER, Timeline  # noqa: E402

VOCAB = 50_000
SPECIAL = VOCAB  # scaffolding ids above the vocabulary: <|im_start|>, <|im_end|>, role names, newline
TURNS, SYSTEM_LEN, USER_LEN, ANSWER_LEN, TOOL_LEN = 5, 300, 40, 60, 120
READS = 200
GROUP = 64  # episodes arriving together
TOOLS: list[dict[str, Any]] = [  # JSON, as `Timeline.tools`
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name.replace('_', ' ')} for the given query; returns JSON text",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    }
    for name in ("search_web", "read_page", "run_python")
]


class Corpus:
    """Words for token ids (Zipf frequencies) and 8 fixed system prompts; the same in every process."""

    def __init__(self) -> None:
        rng = np.random.default_rng(1234)
        letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
        lengths = rng.integers(2, 10, VOCAB)
        self.words = ["".join(rng.choice(letters, n)) for n in lengths]
        weights = 1.0 / (np.arange(VOCAB) + 20.0)
        self.cdf = np.cumsum(weights) / weights.sum()
        self.systems = [self.segment(rng, SYSTEM_LEN) for _ in range(8)]

    def segment(self, rng: np.random.Generator, n: int) -> tuple[list[int], str]:
        ids = np.minimum(np.searchsorted(self.cdf, rng.random(n)), VOCAB - 1)
        return ids.tolist(), " ".join(self.words[i] for i in ids.tolist())


def episode(corpus: Corpus, index: int) -> EpisodeRecord:
    """Episode ``index``, the same in every process (its own seed)."""
    rng = np.random.default_rng([7, index])
    sys_ids, sys_text = corpus.systems[index % len(corpus.systems)]
    user_ids, user_text = corpus.segment(rng, USER_LEN)
    ids: list[int] = []
    authors: list[int] = []
    messages: list[dict] = []
    spans: list[tuple[int, int]] = []

    def add(role: int, author: int, body: list[int]) -> tuple[int, int]:
        ids.extend([SPECIAL, SPECIAL + 2 + role])
        authors.extend([SYSTEM, SYSTEM])
        start = len(ids)
        ids.extend(body)
        authors.extend([author] * len(body))
        ids.extend([SPECIAL + 1, SPECIAL + 6])
        authors.extend([SYSTEM, SYSTEM])
        return start, start + len(body)

    add(0, SYSTEM, sys_ids)
    messages.append({"role": "system", "content": sys_text})
    add(1, USER, user_ids)
    messages.append({"role": "user", "content": user_text})
    timelines = []
    t = 1.7e9 + index * 10.0
    for turn in range(TURNS):
        answer, answer_text = corpus.segment(rng, ANSWER_LEN)
        final = turn == TURNS - 1
        prompt = [*ids, SPECIAL, SPECIAL + 4]
        prompt_authors = [*authors, SYSTEM, SYSTEM]
        response = [*answer, SPECIAL + 1]
        reply: dict[str, object]
        if final:
            reply = {"role": "assistant", "content": answer_text}
        else:
            call: dict[str, object] = {"id": f"call_{index}_{turn}", "type": "function"}
            call["function"] = {
                "name": TOOLS[turn % 3]["function"]["name"],
                "arguments": json.dumps({"query": answer_text}),
            }
            reply = {"role": "assistant", "content": None, "tool_calls": [call]}
        logprobs = (-rng.exponential(0.4, len(response))).astype(np.float32).tolist()
        timelines.append(
            Timeline(
                prompt_ids=prompt,
                response_ids=response,
                response_logprobs=logprobs,
                token_authors=prompt_authors + [MODEL] * len(response),
                loss_mask=[0] * len(prompt) + [1] * len(response),
                # each call's own copies, as the server's timelines hold them (tracking/context.py parses
                # and copies every request's messages): no object shared between timelines
                messages=copy.deepcopy([*messages, reply]),
                tools=copy.deepcopy(TOOLS),
                policy_version=index // 512,
                finish_reason="stop" if final else "tool_calls",
                reused_spans=list(spans),
                started_at=t + turn,
                finished_at=t + turn + 0.5,
            )
        )
        if not final:
            spans.append(add(2, MODEL, answer))
            messages.append(reply)
            tool_ids, tool_text = corpus.segment(rng, TOOL_LEN)
            add(3, TOOL, tool_ids)
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": tool_text})
    return EpisodeRecord(
        episode_id=f"ep-{index:08d}-{rng.integers(1 << 62):016x}",
        model="policy",
        task_id=f"task-{index // 8}",
        group="search",
        state="finished",
        reward=float(rng.random() < 0.4),
        turn_rewards=None,
        reason=None,
        metadata={"repeat": index % 8, "dataset": "synthetic"},
        started_at=t,
        ended_at=t + TURNS,
        timelines=timelines,
    )


def as_json(record: EpisodeRecord) -> dict:
    """What ``Timeline.to_dict`` gives, built without ``asdict``'s deep copy (the same JSON)."""
    timelines = [
        {
            "prompt_ids": t.prompt_ids,
            "response_ids": t.response_ids,
            "response_logprobs": t.response_logprobs,
            "token_authors": t.token_authors,
            "loss_mask": t.loss_mask,
            "messages": t.messages,
            "tools": t.tools,
            "policy_version": t.policy_version,
            "finish_reason": t.finish_reason,
            "drift": [vars(d) for d in t.drift],
            "reused_spans": [list(s) for s in t.reused_spans],
            "started_at": t.started_at,
            "finished_at": t.finished_at,
        }
        for t in record.timelines
    ]
    fields = {k: v for k, v in vars(record).items() if k != "timelines"}
    return {**fields, "timelines": timelines}


def write_jsonl(path: Path, n: int) -> None:
    """Runs beside the store's writer, niced. It syncs its own data every 32 MB and drops it from the page
    cache: on ext4 an fsync of the store would otherwise also write out gigabytes of dirty JSONL (and time
    that), and the JSONL would push the store out of the page cache."""
    os.nice(10)
    corpus = Corpus()
    with open(path, "w") as handle:
        unsynced = 0
        for i in range(n):
            line = json.dumps(as_json(episode(corpus, i))) + "\n"
            handle.write(line)
            unsynced += len(line)
            if unsynced > 32 << 20:
                handle.flush()
                os.fdatasync(handle.fileno())
                os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                unsynced = 0


@dataclass
class Reads:
    opened_ms: float
    median_ms: float
    p90_ms: float
    cpu_ms: float  # median CPU time of this process per read: what the read costs on an idle machine


def read_latency(path: Path, ids: list[str], rng: np.random.Generator) -> Reads:
    """Reads of READS random ids with a fresh reader (the first one also builds the id map)."""
    t0 = time.perf_counter()
    reader = EpisodeReader(path)
    opened = (time.perf_counter() - t0) * 1e3
    wall, cpu = [], []
    for i in rng.choice(len(ids), READS, replace=False).tolist():
        t0, c0 = time.perf_counter(), time.process_time()
        record = reader.episode(ids[i])
        wall.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
        assert record.episode_id == ids[i]
    reader.close()
    return Reads(opened, statistics.median(wall), float(np.percentile(wall, 90)), statistics.median(cpu))


def small_appends(folder: Path, n: int = 2000) -> tuple[float, float, float]:
    """(median ms, p99 ms, median CPU ms) of appending episodes of 5 timelines x ~300 tokens."""
    corpus = Corpus()
    records = []
    for i in range(n):
        record = episode(corpus, i)
        for t in record.timelines:  # keep ~300 tokens per timeline: the last 240 of the prompt
            cut = len(t.prompt_ids) - 240
            t.prompt_ids, t.token_authors, t.loss_mask = (
                x[cut:] for x in (t.prompt_ids, t.token_authors, t.loss_mask)
            )
            t.reused_spans = []
        records.append(record)
    wall, cpu = [], []
    with EpisodeWriter(folder / "small.h5") as writer:
        for record in records:
            t0, c0 = time.perf_counter(), time.process_time()
            writer.append_episode(record)
            wall.append((time.perf_counter() - t0) * 1e3)
            cpu.append((time.process_time() - c0) * 1e3)
    return statistics.median(wall), float(np.percentile(wall, 99)), statistics.median(cpu)


@dataclass
class Groups:
    eps: float  # episodes per second through the recorder, groups of GROUP submitted together
    cpu_ms: float  # CPU time of this process (every thread) per episode while the groups were timed
    fsyncs_per_episode: float
    commits: int
    single_eps: float  # the same episodes one at a time, each waited for (one commit each)
    single_fsyncs_per_episode: float


@dataclass
class Rate:
    seconds: float  # wall time from each group's first submit to its flush, summed
    cpu_s: float  # CPU time of this process (every thread) in the same spans: less moved by other jobs
    fsyncs: int
    commits: int


def recorder_rate(path: Path, corpus: Corpus, first: int, groups: int, size: int) -> Rate:
    """``groups`` groups of ``size`` episodes through a fresh recorder; the episodes are generated before
    each group's clock starts."""
    recorder = EpisodeRecorder(path)
    elapsed = cpu = 0.0
    try:
        for g in range(groups):
            records = [episode(corpus, first + g * size + k) for k in range(size)]
            t0, c0 = time.perf_counter(), time.process_time()
            for record in records:
                recorder.submit_record(record)
            if not recorder.flush(600):
                raise SystemExit("the recorder did not commit a group within 10 minutes")
            elapsed += time.perf_counter() - t0
            cpu += time.process_time() - c0
        stats = recorder.writer.stats
        assert stats.episodes == groups * size and recorder.unwritten_ids() == frozenset()
        return Rate(elapsed, cpu, stats.fsyncs, stats.commits)
    finally:
        recorder.close()


def group_commits(folder: Path, groups: int) -> Groups:
    corpus = Corpus()
    grouped = recorder_rate(folder / "groups.h5", corpus, 0, groups, GROUP)
    n = groups * GROUP
    single = recorder_rate(folder / "single.h5", corpus, 0, n, 1)
    return Groups(
        n / grouped.seconds, grouped.cpu_s / n * 1e3, grouped.fsyncs / n, grouped.commits,
        n / single.seconds, single.fsyncs / n,
    )  # fmt: skip


def client_commits(folder: Path, seconds: float, rate: float = 10.0, in_flight: int = 4) -> tuple[int, int]:
    """(results, journal fsyncs) of a client store whose ``in_flight`` threads commit ``rate`` results a
    second between them for ``seconds``; the fsyncs counted at ``os.fsync`` on the store's journal."""
    store = ClientStore.open(folder / "client" / "0.h5", group="bench", index=0)
    real_fsync, synced = os.fsync, [0]

    def counted(fd: int) -> None:
        synced[0] += fd == store._journal_fd
        real_fsync(fd)

    os.fsync = counted  # type: ignore[assignment]  # counting, then the real call
    start, counter, lock = time.perf_counter(), [0], threading.Lock()

    def agent() -> None:
        while True:
            with lock:
                k = counter[0]
                counter[0] += 1
            due = start + k / rate
            if due - start >= seconds:
                return
            time.sleep(max(0.0, due - time.perf_counter()))
            store.commit(
                ClientResult(f"task-{k}", 0, 1.0, {"policy": 1.0}, {"policy": f"ep-{k}"}, "user: 2+3?\n5", {},
                             time.time())
            )  # fmt: skip

    try:
        threads = [threading.Thread(target=agent) for _ in range(in_flight)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        store.close()
    finally:
        os.fsync = real_fsync
    return len(store.results()), synced[0]


def write_store(h5: Path, n: int, checkpoint: int, rng: np.random.Generator) -> dict:
    corpus = Corpus()
    ids, appends, cpu, tokens, reads = [], [], 0.0, 0, {}
    start = time.perf_counter()
    with EpisodeWriter(h5) as writer:
        for i in range(n):
            record = episode(corpus, i)
            t0, c0 = time.perf_counter(), time.process_time()
            writer.append_episode(record)
            appends.append(time.perf_counter() - t0)
            cpu += time.process_time() - c0
            ids.append(record.episode_id)
            tokens += sum(len(t.prompt_ids) + len(t.response_ids) for t in record.timelines)
            if i + 1 == checkpoint:
                reads[checkpoint] = read_latency(h5, ids, rng)
            if (i + 1) % 10_000 == 0:
                print(f"  {i + 1} episodes, {time.perf_counter() - start:.0f}s", flush=True)
    return {"ids": ids, "appends": sorted(appends), "cpu": cpu, "tokens": tokens, "reads": reads,
            "wall": time.perf_counter() - start}  # fmt: skip


def provenance() -> str:
    """When and from what this ran: the date, the git commit of this checkout (with the tracked files that
    differ from it), the CPUs and the load average."""
    date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    git = ["git", "-C", str(REPO)]
    try:
        commit = subprocess.run([*git, "log", "-1", "--format=%h (%cs)"], capture_output=True, text=True,
                                timeout=30, check=True).stdout.strip()  # fmt: skip
        status = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True, timeout=30, check=True).stdout.splitlines()  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        commit, status = f"unknown ({exc})", []
    changed = f", uncommitted changes in {', '.join(line[3:] for line in status)}" if status else ""
    return f"{date}; commit {commit}{changed}; {load()}"


def load() -> str:
    cpus = len(os.sched_getaffinity(0))
    return f"{cpus} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"


def spread(values: list[float], fmt: str = ".0f") -> str:
    """The median of ``values`` with their range: ``median (min-max of n)``."""
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:{fmt}} (1 run)"
    return f"{med:{fmt}} ({min(values):{fmt}}-{max(values):{fmt}} of {len(values)})"


@dataclass
class Short:
    """One repeat of the short measurements."""

    small: tuple[float, float, float]  # small_appends
    groups: Groups
    client: tuple[int, int]  # client_commits


def short_runs(folder: Path, repeats: int, groups: int, smoke: bool) -> list[Short]:
    """The short measurements, ``repeats`` times, each on fresh files (removed after)."""
    runs = []
    for r in range(repeats):
        sub = folder / f"repeat-{r}"
        sub.mkdir()
        run = Short(
            small_appends(sub, 20) if smoke else small_appends(sub),
            group_commits(sub, groups),
            client_commits(sub, 3.0 if smoke else 10.0),
        )
        shutil.rmtree(sub, ignore_errors=True)
        g = run.groups
        print(
            f"  repeat {r + 1}/{repeats}: groups {g.eps:.0f} episodes/s (CPU {g.cpu_ms:.3f} ms per episode), "
            f"one at a time {g.single_eps:.0f}/s; small appends median {run.small[0]:.2f} ms; client "
            f"{run.client[1]} fsyncs for {run.client[0]} results ({load()})",
            flush=True,
        )
        runs.append(run)
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="20k episodes, reads measured at 10k and 20k")
    parser.add_argument(
        "--smoke", action="store_true", help="200 episodes, 20 small appends, 1 group, 2 repeats (tests)"
    )
    parser.add_argument("--episodes", type=int, default=None, help="episodes to write (default 100k)")
    parser.add_argument(
        "--groups", type=int, default=None, help=f"groups of {GROUP} for group commit (default 32; quick 8)"
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="repeats of the short measurements and reads (default 5)"
    )
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to write (a temporary folder by default)"
    )
    args = parser.parse_args(argv)
    n = args.episodes or (200 if args.smoke else 20_000 if args.quick else 100_000)
    repeats = args.repeats or (2 if args.smoke else 5)
    if repeats < 1:
        parser.error("--repeats must be at least 1")
    checkpoint = min(10_000, n)
    print(f"store benchmark, {provenance()}", flush=True)
    folder = Path(tempfile.mkdtemp(prefix="ajet-bench-store-", dir=args.dir))
    h5, jsonl = folder / "policy.h5", folder / "policy.jsonl"
    rng = np.random.default_rng(99)
    try:
        groups = args.groups or (1 if args.smoke else 8 if args.quick else 32)
        short = short_runs(folder, repeats, groups, args.smoke)
        child = multiprocessing.get_context("spawn").Process(target=write_jsonl, args=(jsonl, n))
        child.start()
        run = write_store(h5, n, checkpoint, rng)
        t0 = time.perf_counter()
        with EpisodeReader(h5) as reader:
            assert len(reader.summaries()) == n
        summaries_s = time.perf_counter() - t0
        child.join()
        if child.exitcode != 0:
            raise SystemExit(f"the JSONL writer failed (exit code {child.exitcode})")
        final_reads = [read_latency(h5, run["ids"], rng) for _ in range(repeats)]
        h5_size, jsonl_size = h5.stat().st_size, jsonl.stat().st_size
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    report(n, run, final_reads, short, summaries_s, h5_size, jsonl_size, checkpoint)
    return 0


def report(
    n: int,
    run: dict,
    final_reads: list[Reads],
    short: list[Short],
    summaries_s: float,
    h5_size: int,
    jsonl_size: int,
    checkpoint: int,
) -> None:
    tokens, per = run["tokens"], run["appends"]
    write_eps = n / sum(per)
    print(f"episodes {n}, tokens {tokens} ({tokens / n:.0f} per episode), chunk 65536 tokens, deflate")
    print(f"HDF5  {h5_size / 1e6:9.1f} MB  ({h5_size / tokens:.2f} bytes/token)")
    print(f"JSONL {jsonl_size / 1e6:9.1f} MB  ({jsonl_size / tokens:.2f} bytes/token)")
    print(f"size ratio JSONL/HDF5 {jsonl_size / h5_size:.2f}")
    print(
        f"append ({tokens / n:.0f} tokens), one run of {n}: {write_eps:.0f} episodes/s inside "
        f"append_episode; per episode median {per[len(per) // 2] * 1e3:.2f} ms, p99 "
        f"{per[int(len(per) * 0.99)] * 1e3:.2f} ms, max {per[-1] * 1e3:.0f} ms, "
        f"CPU {run['cpu'] / n * 1e3:.2f} ms; with generation {n / run['wall']:.0f}/s"
    )
    print("median of the repeats (min-max of their number):")
    small = [s.small for s in short]
    print(
        f"append (5 x ~300 tokens): median {spread([x[0] for x in small], '.2f')} ms, p99 "
        f"{spread([x[1] for x in small], '.2f')} ms, CPU median {spread([x[2] for x in small], '.2f')} ms"
    )
    early = run["reads"][checkpoint]
    print(
        f"read by id at {checkpoint} episodes, writer appending (one run): median {early.median_ms:.2f} ms "
        f"(CPU {early.cpu_ms:.2f} ms), p90 {early.p90_ms:.2f} ms; fresh reader opened in "
        f"{early.opened_ms:.1f} ms"
    )
    print(
        f"read by id at {n} episodes: median {spread([r.median_ms for r in final_reads], '.2f')} ms "
        f"(CPU {spread([r.cpu_ms for r in final_reads], '.2f')} ms), p90 "
        f"{spread([r.p90_ms for r in final_reads], '.2f')} ms; fresh reader opened in "
        f"{spread([r.opened_ms for r in final_reads], '.1f')} ms"
    )
    print(f"summaries() of {n} episodes with a fresh reader (one run): {summaries_s:.2f} s")
    groups = [s.groups for s in short]
    group_eps = [g.eps for g in groups]
    print(
        f"recorder, groups of {GROUP} arriving together: {spread(group_eps)} episodes/s, CPU "
        f"{spread([g.cpu_ms for g in groups], '.3f')} ms per episode, "
        f"{spread([g.fsyncs_per_episode for g in groups], '.3f')} fsyncs per episode ({groups[0].commits} "
        f"commits); one at a time: {spread([g.single_eps for g in groups])} episodes/s, "
        f"{spread([g.single_fsyncs_per_episode for g in groups], '.3f')} fsyncs per episode; ratio "
        f"{spread([g.eps / g.single_eps for g in groups], '.2f')}"
    )
    per_result = [fsyncs / results for results, fsyncs in (s.client for s in short)]
    print(
        f"client store, 10 results/s from 4 threads: {spread([float(s.client[0]) for s in short])} results, "
        f"{spread([float(s.client[1]) for s in short])} journal fsyncs"
    )
    print(f"ended {datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC; {load()}")
    print(
        f"RESULT size_ratio={jsonl_size / h5_size:.2f} write_eps={write_eps:.0f} "
        f"read_ms_10k={early.median_ms:.2f} "
        f"read_ms_100k={statistics.median(r.median_ms for r in final_reads):.2f} "
        f"write_eps_group={statistics.median(group_eps):.0f} write_eps_group_min={min(group_eps):.0f} "
        f"write_eps_group_max={max(group_eps):.0f} "
        f"cpu_ms_group={statistics.median(g.cpu_ms for g in groups):.3f} "
        f"fsyncs_per_episode={statistics.median(g.fsyncs_per_episode for g in groups):.3f} "
        f"fsyncs_per_episode_client={statistics.median(per_result):.3f} repeats={len(short)}"
    )


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
