"""How busy the machine was during each test: a pytest plugin that writes when each test starts and ends,
a sampler of ``/proc/stat``, and a report that joins the two (tests/README.md, "Where the time went").

    .venv/bin/python tools/test_load.py sample cpu.log &                      # every 5 s until killed
    TEST_TIMING_OUT=timing.tsv PYTHONPATH=tools PYTEST_ARGS="-p test_load" bash .ci/run
    .venv/bin/python tools/test_load.py report timing.tsv cpu.log            # per tier, slowest tests

The share is of the whole machine (1.0: every core busy the whole time), whoever used it; a test shorter
than two samples gets the share of the samples around it.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from pathlib import Path

SAMPLE_S = 5.0
_out = None


def _write(kind: str, nodeid: str) -> None:
    global _out
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # under pytest-xdist the controller writes every test's lines, as the workers report them
    if _out is None:
        _out = open(os.environ.get("TEST_TIMING_OUT", "test-timing.tsv"), "a", buffering=1)  # noqa: SIM115
    _out.write(f"{time.time():.2f}\t{kind}\t{nodeid}\n")


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    _write("start", nodeid)


def pytest_runtest_logfinish(nodeid: str, location: object) -> None:
    _write("end", nodeid)


def sample(path: Path) -> None:
    with path.open("a", buffering=1) as out:
        while True:
            with open("/proc/stat") as stat:
                out.write(f"{time.time():.2f} {stat.readline()}")
            time.sleep(SAMPLE_S)


def busy_share(samples: list[tuple[float, int, int]], start: float, end: float) -> float | None:
    """The machine's busy share between ``start`` and ``end`` (the samples around them)."""
    inside = [s for s in samples if start - SAMPLE_S / 2 <= s[0] <= end + SAMPLE_S / 2]
    if len(inside) < 2:
        return None
    (_, idle0, total0), (_, idle1, total1) = inside[0], inside[-1]
    return 1 - (idle1 - idle0) / max(1, total1 - total0)


def report(timing: Path, cpu_log: Path, top: int) -> None:
    samples = []
    for line in cpu_log.read_text().splitlines():
        at, _, *fields = line.split()
        ticks = [int(f) for f in fields[:8]]
        samples.append((float(at), ticks[3] + ticks[4], sum(ticks)))  # idle + iowait, all
    starts: dict[str, float] = {}
    tests = []
    for line in timing.read_text().splitlines():
        at, kind, nodeid = line.split("\t")
        if kind == "start":
            starts[nodeid] = float(at)
        elif nodeid in starts:
            tests.append((nodeid, starts.pop(nodeid), float(at)))
    tiers: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    shares = {}
    for nodeid, start, end in tests:
        share = busy_share(samples, start, end)
        shares[nodeid] = share
        tier = nodeid.split("/")[1] if nodeid.startswith("tests/") else nodeid.split("/")[0]
        tiers[tier][0] += end - start
        tiers[tier][1] += (end - start) * (share if share is not None else 1.0)
    for tier, (wall, busy) in tiers.items():
        print(f"{tier:10s} {wall:7.0f} s  busy {busy / max(wall, 1e-9):.2f}")
    for nodeid, start, end in sorted(tests, key=lambda t: t[1] - t[2])[:top]:
        share = shares[nodeid]
        print(
            f"{end - start:7.1f} s  busy {share:.2f}  {nodeid}"
            if share is not None
            else f"{end - start:7.1f} s  {nodeid}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("sample", help="append /proc/stat every 5 s").add_argument("cpu_log", type=Path)
    shown = commands.add_parser("report", help="busy share per tier and per test")
    shown.add_argument("timing", type=Path)
    shown.add_argument("cpu_log", type=Path)
    shown.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    if args.command == "sample":
        sample(args.cpu_log)
    else:
        report(args.timing, args.cpu_log, args.top)


if __name__ == "__main__":
    main()
