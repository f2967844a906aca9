"""Where the test suite's end-to-end time goes, by phase, read from the server logs its runs left behind.

    .venv/bin/python tools/test_phases.py BASETEMP      # a pytest base folder (pytest-of-$USER/pytest-N)

Every ``logs/server-*/*_log.out`` under the folder is a server job's log (local or Slurm; a requeued
job appends its next start to the same file). Each start of a server is cut into phases by the log
lines the server writes:

- ``start``: the interpreter and its imports (the first line of the start to ``listening on``);
- ``engine``: the engine's load (``listening on`` to ``... engine: loaded``);
- ``ready``: the rest of the assembly (the engine loaded to ``ready at``);
- ``first step``: DeepSpeed's ranks, the clients' start and the first batch (``ready at`` to the first
  step's line, or to ``resumed ... at step``);
- ``training``: the steps and eval rounds (the first step to ``training of ... finished``);
- ``stop``: the end of training to the server's last line;
- ``cut short``: a start that never finished its training (stopped by a signal, killed, or serving only):
  its last phase's line to its last line;
- ``requeue gap``: the last line of one start to the first of the next (Slurm's requeue, its credential
  wait, the scheduler).

A start that ends before a phase's line leaves that phase out (a killed or serve-only server). Prints one
row per phase (seconds summed over every start, the number of starts that had it) and the engines loaded.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from datetime import datetime
from pathlib import Path

STAMP = re.compile(r"(\d{4}-\d\d-\d\d) (\d\d:\d\d:\d\d)")
# the line that ends each phase, in order: (phase, pattern)
MARKS = [
    ("start", re.compile(r"INFO ajet_hpc\.server\.process: server \S+ \(job .*listening on")),
    ("engine", re.compile(r"INFO ajet_hpc\.engine\.\w+: (\w+) engine: loaded /")),
    ("ready", re.compile(r"INFO ajet_hpc\.server\.process: ready at")),
    ("first step", re.compile(r"coordinator(?:\.loop)?: (step 1/|resumed \S+ at step)")),
    ("training", re.compile(r"coordinator(?:\.loop)?: training of \S+ finished")),
]
BEGIN = re.compile(r"submitit INFO \((\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)")


def stamp(line: str) -> datetime | None:
    found = STAMP.search(line)
    return datetime.fromisoformat(f"{found[1]} {found[2]}") if found else None


def starts(text: str) -> list[list[str]]:
    """The log cut at each ``Starting with JobEnvironment`` (one piece per start of the job)."""
    pieces: list[list[str]] = [[]]
    for line in text.splitlines():
        if "Starting with JobEnvironment" in line and pieces[-1]:
            pieces.append([])
        pieces[-1].append(line)
    return [p for p in pieces if p]


def phases(
    lines: list[str], totals: Counter[str], counts: Counter[str], engines: Counter[str]
) -> tuple[datetime, datetime]:
    """Adds one start's phases to ``totals``; its first and last time stamps. Each phase ends at the first
    line of its mark after the previous phase's; a mark never written leaves its phase out."""
    stamped = [(t, line) for line in lines if (t := stamp(line))]
    at, index = stamped[0][0], 0
    for name, pattern in MARKS:
        hit = next((i for i in range(index, len(stamped)) if pattern.search(stamped[i][1])), None)
        if hit is None:
            continue
        t, line = stamped[hit]
        totals[name] += round((t - at).total_seconds())
        counts[name] += 1
        if name == "engine":
            engines[pattern.search(line)[1]] += 1  # type: ignore[index]
        at, index = t, hit
    rest = "stop" if index and MARKS[-1][1].search(stamped[index][1]) else "cut short"
    totals[rest] += round((stamped[-1][0] - at).total_seconds())
    counts[rest] += 1
    return stamped[0][0], stamped[-1][0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--per-run", action="store_true", help="also one line per run folder")
    args = parser.parse_args()
    totals: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    engines: Counter[str] = Counter()
    logs = sorted(args.folder.glob("**/logs/server-*/*_log.out"))
    per_run: dict[Path, Counter[str]] = {}
    for log in logs:
        before = totals.copy()
        previous_end = None
        for piece in starts(log.read_text(errors="replace")):
            if not any(stamp(line) for line in piece):
                continue
            first, last = phases(piece, totals, counts, engines)
            if previous_end is not None:
                totals["requeue gap"] += round((first - previous_end).total_seconds())
                counts["requeue gap"] += 1
            previous_end = last
        run = log.parents[2]
        per_run.setdefault(run, Counter()).update(totals - before)
    print(f"{len(logs)} server logs under {args.folder}")
    for name in [*(m for m, _ in MARKS), "stop", "cut short", "requeue gap"]:
        print(f"{name:12s} {totals[name]:8.0f} s  over {counts[name]:4d} starts")
    print("engines loaded:", dict(engines))
    if args.per_run:
        names = [*(m for m, _ in MARKS), "stop", "cut short", "requeue gap"]
        print("run " + " ".join(f"{n[:10]:>10s}" for n in names))
        for run, phase in sorted(per_run.items(), key=lambda item: -sum(item[1].values())):
            print(f"{run.relative_to(args.folder)}\n    " + " ".join(f"{phase[n]:10d}" for n in names))


if __name__ == "__main__":
    main()
