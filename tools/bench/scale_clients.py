"""Many client array tasks in one process, for ``scale.py``: ``scale_clients.py RUN GROUP FIRST COUNT``.

Array tasks FIRST .. FIRST+COUNT-1 of client group GROUP, each the runner's real worker
(``runner.group_task``: its own client store and lease, its ``in_flight`` episode threads, discovery,
the episode API with the run's auth) in a thread of this process, as ``runner_process.run_client`` runs one
in a process of its own. What one process per task would add (an interpreter and its imports, tens of MB and
a second or two of CPU each) is left out so that thousands of open episodes fit on one machine.

The group's agent is imported first, in the main thread: ``scale_agent`` takes SIGUSR1 as the release of
its held episodes. Exits 0 when every task ended (its shard done or the server finished), 1 otherwise.
"""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for folder in (REPO, HERE):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from ajet_hpc.client.array_task import pick_group  # noqa: E402
from ajet_hpc.client.runner import group_task  # noqa: E402
from ajet_hpc.environments.sources import import_entry  # noqa: E402
from ajet_hpc.logging_setup import setup_logging  # noqa: E402
from ajet_hpc.storage.rundir import RunDir  # noqa: E402

log = logging.getLogger("scale_clients")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 4:
        raise SystemExit("usage: scale_clients.py RUN GROUP FIRST COUNT")
    setup_logging()
    run = RunDir.at(args[0])
    topology = run.load_topology()
    group = pick_group(topology, args[1])
    first, count = int(args[2]), int(args[3])
    import_entry(group.agent)  # in the main thread: the agent's signal handler
    workers = [group_task(run, topology, group, index) for index in range(first, first + count)]
    failed: list[int] = []

    def run_one(worker) -> None:
        try:
            worker.run()
        except Exception:
            log.exception("client %s[%d] failed", group.name, worker.index)
            failed.append(worker.index)
        finally:
            worker.store.close()

    threads = [threading.Thread(target=run_one, args=(w,), name=f"task-{w.index}") for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failed += [w.index for w in workers if w.gone is not None or w.store_failed is not None]
    if failed:
        log.error("tasks %s of group %s did not end well", sorted(set(failed)), group.name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
