"""The run directory: the single source of truth of a run, on storage shared by every node.

The folders are private to their owner (0700), or 0750 and owned by ``cluster.share_group`` when set
(``prepare`` tightens them on every launch).

Layout (see docs/architecture.md)::

    RUN/topology.yaml        resolved topology, frozen at first launch (changed only by --force and by
                             hot swaps of client groups, the earlier one kept as topology.<time>.yaml)
    RUN/swaps.jsonl          one row per hot swap or added client group
    RUN/swap.lock            held by the hot swap under way
    RUN/secret               mode 0600, the key of every token of this run
    RUN/jobs.json            jobs submitted for this run (backend, ids, log folders)
    RUN/servers/<name>.json  rendezvous of each server (written by rename)
    RUN/ckpt/<model>/        checkpoints
    RUN/data/                HDF5 stores; data/clients/<group>/<index>.end.json: that task's work is over
    RUN/logs/                one folder per job
"""

from __future__ import annotations

import difflib
import os
import secrets
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from ajet_hpc.config import ConfigError, Topology, dump_topology, load_topology
from ajet_hpc.storage.files import write_bytes_atomic

TOPOLOGY_FILE = "topology.yaml"


class RunDirError(Exception):
    """The run directory cannot be used as asked (a changed topology, a missing file...)."""


@dataclass(frozen=True)
class RunDir:
    root: Path

    @classmethod
    def for_topology(cls, topology: Topology, base: Path | None = None) -> RunDir:
        """Where a topology's run lives: ``run.dir``, else ``runs/<name>``, relative to ``base`` (cwd)."""
        return cls(topology.run.resolve_dir(base))

    @classmethod
    def at(cls, path: str | os.PathLike[str]) -> RunDir:
        """An existing run directory, with a clear error when ``path`` is not one."""
        root = Path(path).resolve()
        if not (root / TOPOLOGY_FILE).is_file():
            raise RunDirError(f"{root} is not a run directory (no {TOPOLOGY_FILE} in it)")
        return cls(root)

    # --- paths -------------------------------------------------------------------------------------
    @property
    def topology_file(self) -> Path:
        return self.root / TOPOLOGY_FILE

    @property
    def secret_file(self) -> Path:
        return self.root / "secret"

    @property
    def setup_file(self) -> Path:
        """``cluster.setup`` as shell lines: the hand-written ``sbatch/*.sbatch`` scripts source it before
        the job starts (submitit and the hetjob script write the lines into their job scripts)."""
        return self.root / "setup.sh"

    @property
    def jobs_file(self) -> Path:
        return self.root / "jobs.json"

    @property
    def swaps_file(self) -> Path:
        return self.root / "swaps.jsonl"

    @property
    def swap_lock_file(self) -> Path:
        """Held (created exclusively) by the one hot swap of the run under way (``launch.swap``)."""
        return self.root / "swap.lock"

    @property
    def servers_dir(self) -> Path:
        return self.root / "servers"

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    def client_store_dir(self, group: str) -> Path:
        """Where a client group keeps its stores: ``data/clients/<group>/<index>.h5``."""
        return self.data_dir / "clients" / group

    def client_store(self, group: str, index: int) -> Path:
        """Array task ``index`` of ``group``'s client store (``data/clients/<group>/<index>.h5``)."""
        return self.client_store_dir(group) / f"{index}.h5"

    def client_end_file(self, group: str, index: int) -> Path:
        """Written once array task ``index`` of ``group`` has nothing left to run (``storage.task_ends``)."""
        return self.client_store_dir(group) / f"{index}.end.json"

    @property
    def ckpt_dir(self) -> Path:
        return self.root / "ckpt"

    def trainer_dir(self, server: str) -> Path:
        """A server's trainer work folder: its ranks' file protocol, checkpoints and consumed journal."""
        return self.ckpt_dir / server

    def server_store(self, server: str) -> Path:
        """A server's episode store (``data/<server>.h5``)."""
        return self.data_dir / f"{server}.h5"

    @property
    def metrics_file(self) -> Path:
        """One JSON row per trained step and event, of every trained server
        (``trainer.coordinator.metrics``)."""
        return self.root / "metrics.jsonl"

    @property
    def models_dir(self) -> Path:
        """Where models named by the topology are built or linked (``engine.model_path``)."""
        return self.root / "models"

    def rendezvous_file(self, server: str) -> Path:
        return self.servers_dir / f"{server}.json"

    def job_log_dir(self, job_name: str) -> Path:
        return self.logs_dir / job_name

    # --- lifecycle ---------------------------------------------------------------------------------
    def exists(self) -> bool:
        return self.topology_file.is_file()

    def load_topology(self) -> Topology:
        return load_topology(self.topology_file)

    def holds(self, frozen_text: str) -> bool:
        """Whether the frozen topology is ``frozen_text`` (a ``dump_topology``), in either form of a
        server."""
        old_text = self.topology_file.read_text()
        return old_text == frozen_text or _in_this_form(self.topology_file) == frozen_text

    def prepare(self, topology: Topology, force: bool = False) -> str:
        """Create the run directory, or check that ``topology`` matches the frozen one.

        Returns ``"created"``, ``"resumed"`` or ``"replaced"`` (changed topology with ``force``).
        """
        frozen_text = dump_topology(topology)
        state = "created"
        if self.exists():
            old_text = self.topology_file.read_text()
            if self.holds(frozen_text):
                state = "resumed"
            elif not force:
                diff = "".join(
                    difflib.unified_diff(
                        old_text.splitlines(keepends=True),
                        frozen_text.splitlines(keepends=True),
                        fromfile="frozen topology",
                        tofile="this launch",
                    )
                )
                swapped = (
                    f"Its client groups were changed while it ran (see {self.swaps_file.name}): resume it "
                    f"with 'python -m ajet_hpc.launch {self.root}'.\n"
                    if self.swaps_file.exists()
                    else ""
                )
                raise RunDirError(
                    f"{self.root} already holds a run with a different topology:\n{diff}{swapped}"
                    "Launch with --force to replace it (the old one is kept as topology.<time>.yaml), "
                    "or choose another run.dir."
                )
            else:
                self.topology_file.rename(self._history_name())
                state = "replaced"
        for folder in (self.root, self.servers_dir, self.logs_dir, self.data_dir, self.ckpt_dir):
            folder.mkdir(parents=True, exist_ok=True)
            self._restrict(folder, topology.cluster.share_group)
        self._ensure_secret()
        if state != "resumed":
            write_bytes_atomic(self.topology_file, frozen_text.encode())
        write_bytes_atomic(self.setup_file, _setup_script(topology.cluster.setup).encode())
        return state

    def replace_topology(self, topology: Topology) -> Path:
        """Freeze ``topology`` in place of the current one (a hot swap), by rename: a job starting meanwhile
        reads the old or the new one. Returns where the old one is kept (``topology.<time>.yaml``)."""
        kept = self._history_name()
        kept.write_bytes(self.topology_file.read_bytes())
        write_bytes_atomic(self.topology_file, dump_topology(topology).encode())
        return kept

    def earlier_topologies(self) -> list[Path]:
        """The topologies this run had before (``topology.<time>.yaml``, kept by a hot swap or a forced
        relaunch), oldest first."""
        return sorted(self.root.glob("topology.*.yaml"))

    def _history_name(self) -> Path:
        """A free ``topology.<time>[-N].yaml`` for the topology being replaced."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        candidate, n = self.root / f"topology.{stamp}.yaml", 1
        while candidate.exists():
            n += 1
            candidate = self.root / f"topology.{stamp}-{n}.yaml"
        return candidate

    @staticmethod
    def _restrict(folder: Path, share_group: str | None) -> None:
        """``folder`` private to its owner (0700), or readable by ``share_group`` (0750, that group): a
        neighbour who could write into the run could plant a rendezvous or a checkpoint (umask 002 makes
        new folders group-writable)."""
        try:
            if share_group is not None:
                shutil.chown(folder, group=share_group)
            os.chmod(folder, 0o700 if share_group is None else 0o750)
        except (LookupError, PermissionError) as exc:
            whose = f"give {folder} to group {share_group!r}" if share_group else f"make {folder} private"
            raise RunDirError(
                f"cannot {whose} (cluster.share_group): {exc}; the run directory must be yours, and "
                "share_group a group you belong to (see `id -Gn`)"
            ) from exc

    def _ensure_secret(self) -> None:
        path = self.secret_file
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            mode = stat.S_IMODE(path.stat().st_mode)
            if mode & 0o077:
                os.chmod(path, 0o600)
            return
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_hex(32) + "\n")

    def read_secret(self) -> str:
        try:
            value = self.secret_file.read_text().strip()
        except FileNotFoundError as exc:
            raise RunDirError(f"{self.secret_file} is missing: relaunch to create it") from exc
        if not value:
            raise RunDirError(f"{self.secret_file} is empty")
        return value


def _setup_script(lines: list[str]) -> str:
    header = "# cluster.setup of this run's topology: sbatch/*.sbatch source this before the job starts\n"
    return header + "".join(f"{line}\n" for line in lines)


def _in_this_form(topology_file: Path) -> str | None:
    """A frozen topology as this version writes it (one frozen before servers had an engine block and
    ``models:`` is in the old form: ``config.old_form``); None when it no longer loads."""
    try:
        return dump_topology(load_topology(topology_file))
    except ConfigError:
        return None
