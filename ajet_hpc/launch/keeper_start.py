"""Whether a server job starts the keeper of its client arrays (``keeper.py``), and the start itself.

Apart from the keeper's own module because the server job's entries (``jobs.ServerJob``, ``server_job``)
import it: the keeper's loop imports the Slurm backend, which imports those job callables.
"""

from __future__ import annotations

import subprocess
import sys

from ajet_hpc.config import ClientGroupConfig, Topology
from ajet_hpc.slurm import environment
from ajet_hpc.storage.rundir import RunDir


def kept_groups(topology: Topology, server: str) -> list[ClientGroupConfig]:
    """The client groups (eval groups too) whose first model ``server`` serves, with resubmits allowed."""
    groups = [*topology.clients, *topology.eval_groups.values()]
    return [g for g in groups if g.max_resubmits > 0 and topology.host_of(g.servers[0]).name == server]


def start(run: RunDir, topology: Topology, server: str) -> subprocess.Popen[bytes] | None:
    """The keeper of the client arrays whose first model ``server`` serves, as a child process of the
    caller (the serving process: the keeper watches its parent); None off Slurm or when no such group has
    ``max_resubmits``. A process of its own: submitting jobs is the launcher's code, not the server's."""
    if not environment.current().on_slurm or not kept_groups(topology, server):
        return None
    return subprocess.Popen([sys.executable, "-m", "ajet_hpc.launch.keeper", str(run.root), server])
