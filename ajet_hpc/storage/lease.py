"""The writer lease of a server store: which process, on which node, may write ``RUN/data/<model>.h5``.

A lease is a small JSON file next to the store (``<model>.h5.lease``) that names its holder (host, pid,
Slurm job, a random token) and carries a heartbeat time, refreshed by a daemon thread. It works on NFS and
Lustre without POSIX locks: a fresh lease is created with ``link`` (atomic and exclusive on the file server),
a stale one is taken over by one taker at a time (an exclusive *claim* file named after the stale token).
A healthy holder's heartbeat rewrites the file in place through its open descriptor (no name looked up:
thousands of client tasks' heartbeats cost the metadata server nothing); after a stall a refresh writes a
whole file under a temporary name and renames it over the lease after checking that it is still ours.
The guarantee and its limits: docs/storage.md, "The writer lease".

A lease is stale when its holder is a dead process on this host, or this Slurm job before Slurm requeued
it, or when its heartbeat is older than the timeout the holder wrote into it (nodes' clocks must agree to
well within that timeout: NTP does).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import secrets
import socket
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from ajet_hpc.storage.files import pid_alive
from ajet_hpc.storage.h5_layout import StoreError

log = logging.getLogger(__name__)

_TRIES = 20  # rounds of look-and-take before giving up on a lease that keeps changing
LEASE_BYTES = 512  # a lease file's length (longer only if its JSON is: a very long host name)
_EXPIRED = "its heartbeat is older than its timeout"  # the one stale case where the holder may be alive


@dataclass(frozen=True)
class LeaseTiming:
    """How often a writer renews its lease, and when others may call it stale."""

    heartbeat_s: float = 5.0  # period of the heartbeat thread
    timeout_s: float = 20.0  # a lease whose heartbeat is older than this may be taken over
    settle_s: float = 1.0  # after taking over a lease from a maybe-frozen holder: wait, then check it held

    def __post_init__(self) -> None:
        if self.heartbeat_s <= 0:
            raise ValueError(f"LeaseTiming.heartbeat_s must be > 0, got {self.heartbeat_s}")
        if self.timeout_s < 3 * self.heartbeat_s:
            raise ValueError(
                f"LeaseTiming.timeout_s ({self.timeout_s}) must be at least 3 × heartbeat_s "
                f"({self.heartbeat_s}): a healthy writer that misses one beat must not look stale"
            )
        if self.settle_s < 0:
            raise ValueError(f"LeaseTiming.settle_s must be >= 0, got {self.settle_s}")


@dataclass(frozen=True)
class Lease:
    """The content of a lease file: who writes the store, and how recently it said so."""

    host: str
    pid: int
    job_id: str | None  # SLURM_JOB_ID of the holder, if it ran under Slurm
    restarts: int  # SLURM_RESTART_COUNT: how often Slurm had requeued that job
    token: str  # random, one per writer: tells two leases of one process apart
    started_at: float  # wall-clock time the holder took the lease
    heartbeat_at: float  # wall-clock time of its last heartbeat
    heartbeat_s: float
    timeout_s: float

    def age(self, now: float | None = None) -> float:
        """Seconds since the last heartbeat (negative if the holder's clock runs ahead of ours)."""
        return (time.time() if now is None else now) - self.heartbeat_at

    def describe(self) -> str:
        job = f", Slurm job {self.job_id}" if self.job_id else ""
        return f"host {self.host}, pid {self.pid}{job}, last heartbeat {self.age():.1f} s ago"

    def to_bytes(self) -> bytes:
        """The file's content: JSON, padded with spaces to at least ``LEASE_BYTES`` (a heartbeat rewrites
        the file in place; a fixed length keeps its size, so a renewal changes no metadata but the time)."""
        text = json.dumps(asdict(self), indent=2, sort_keys=True)
        return (text.ljust(LEASE_BYTES - 1) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, path: Path) -> Lease:
        try:
            raw = json.loads(data)
            return cls(**{f.name: raw[f.name] for f in fields(cls)})
        except (ValueError, TypeError, KeyError) as exc:
            raise StoreError(
                f"{path}: not a writer lease ({exc!r}); if no server writes the store next to it, "
                "remove this file and start again"
            ) from exc


def lease_path(store: Path) -> Path:
    """The lease file of ``store``: ``<store>.lease`` in the same folder."""
    return store.with_name(store.name + ".lease")


def read_lease(store: Path) -> Lease | None:
    """The current lease of ``store`` (who writes it, or last wrote it without closing), or None."""
    return _read(lease_path(Path(store)))


def _read(path: Path) -> Lease | None:
    for attempt in range(5):
        try:
            return Lease.from_bytes(path.read_bytes(), path)
        except FileNotFoundError:
            return None
        except OSError as exc:  # NFS: the file we looked up was renamed over meanwhile
            if exc.errno != errno.ESTALE or attempt == 4:
                raise
        except StoreError:  # read while its holder rewrote it in place: the next read is whole
            if attempt == 4:
                raise
            time.sleep(0.01)
    return None


def _new_lease(timing: LeaseTiming) -> Lease:
    now = time.time()
    return Lease(
        host=socket.gethostname(),
        pid=os.getpid(),
        job_id=os.environ.get("SLURM_JOB_ID"),
        restarts=_restarts(),
        token=secrets.token_hex(8),
        started_at=now,
        heartbeat_at=now,
        heartbeat_s=timing.heartbeat_s,
        timeout_s=timing.timeout_s,
    )


def _restarts() -> int:
    return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)


def stale_reason(lease: Lease) -> str | None:
    """Why ``lease`` no longer protects anything (then it may be taken over), or None while it does."""
    if lease.job_id and lease.job_id == os.environ.get("SLURM_JOB_ID") and lease.restarts < _restarts():
        return "it is this Slurm job's own, from before Slurm requeued it (that run has ended)"
    if lease.host == socket.gethostname():
        if lease.pid == os.getpid():
            return "it is this process's own, left by a writer that was not closed"
        if not pid_alive(lease.pid):
            return "its process is dead"
    if lease.age() > lease.timeout_s:
        return f"{_EXPIRED} of {lease.timeout_s:g} s"
    return None


# ------------------------------------------------------------------------------------------ file ops
def _write_tmp(path: Path, lease: Lease) -> Path:
    """``lease`` written and fsynced under a unique temporary name in the lease's folder."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(lease.to_bytes())
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def _link_exclusive(src: Path, dst: Path) -> bool:
    """Give ``src`` the name ``dst`` unless ``dst`` exists; True if we did (atomic on NFS and Lustre)."""
    try:
        os.link(src, dst)
    except FileExistsError:
        # NFS: a retransmitted LINK whose first try succeeded answers EEXIST; the link count tells.
        return os.stat(src).st_nlink == 2
    return True


def _claim_path(path: Path, token: str) -> Path:
    return path.with_name(f"{path.name}.takeover-{token}")


# ----------------------------------------------------------------------------------------- acquiring
def acquire_lease(store: Path, timing: LeaseTiming, on_lost: Callable[[], None]) -> HeldLease:
    """Take the writer lease of ``store`` and start its heartbeat; StoreError naming the holder if a live
    writer has it. ``on_lost``, a bound method, is called from the heartbeat thread if the lease is taken
    away later (through a weak reference: the thread does not keep its object alive)."""
    path = lease_path(store)
    path.parent.mkdir(parents=True, exist_ok=True)
    mine = _new_lease(timing)
    for _ in range(_TRIES):
        mine = replace(mine, heartbeat_at=time.time())
        current = _read(path)
        if current is None:
            if _create(path, mine):
                return HeldLease(store, mine, timing, on_lost, None)
        else:
            reason = stale_reason(current)
            if reason is None:
                raise _refusal(store, path, current)
            if _take_over(store, path, current, mine, reason, timing):
                return HeldLease(store, mine, timing, on_lost, current)
        time.sleep(random.uniform(0.01, 0.05))  # someone else moved first: look again
    raise StoreError(
        f"{store}: could not take the writer lease {path}: other processes kept taking it at the same time"
    )


def _refusal(store: Path, path: Path, holder: Lease) -> StoreError:
    stop = f"scancel {holder.job_id}" if holder.job_id else f"kill {holder.pid} on {holder.host}"
    expires = max(0.0, holder.timeout_s - holder.age())
    return StoreError(
        f"{store}: another process writes this store ({holder.describe()}; lease {path}). "
        f"One writer per store: stop that writer ({stop}) before starting another; if it is gone, its "
        f"lease expires {expires:.0f} s from now and the next writer takes it over"
    )


def _create(path: Path, mine: Lease) -> bool:
    """Create the lease where there is none; False if another process created one first."""
    tmp = _write_tmp(path, mine)
    try:
        return _link_exclusive(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _take_over(store: Path, path: Path, old: Lease, mine: Lease, reason: str, timing: LeaseTiming) -> bool:
    """Replace the stale lease ``old`` by ``mine``. One taker at a time: the one that creates the claim
    file named after ``old``'s token; it checks that the lease is still ``old`` before replacing it."""
    claim = _claim_path(path, old.token)
    tmp = _write_tmp(path, mine)
    try:
        if not _link_exclusive(tmp, claim):
            _clear_stale_claim(claim)
            return False
        try:
            if _read(path) != old:
                return False  # renewed, released or taken meanwhile
            log.warning("%s: taking over the writer lease of %s: %s", store, old.describe(), reason)
            os.replace(tmp, path)
        finally:
            claim.unlink(missing_ok=True)
    finally:
        tmp.unlink(missing_ok=True)
    if reason.startswith(_EXPIRED):  # the holder may be alive (frozen): did it renew meanwhile?
        time.sleep(timing.settle_s)
        current = _read(path)
        if current is None or current.token != mine.token:
            log.warning("%s: the lease changed hands while we took it over", store)
            return False
    return True


def _clear_stale_claim(claim: Path) -> None:
    """Remove a claim whose taker died before finishing (the same staleness rules as a lease)."""
    try:
        taker = _read(claim)
    except StoreError:
        return
    if taker is not None and stale_reason(taker) is not None:
        log.warning("%s: removing a takeover claim left by %s", claim, taker.describe())
        claim.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------- holding
class LeaseLost(StoreError):
    """This writer's lease was taken over (or removed): it must not write the store any more."""


class HeldLease:
    """A lease we hold: renewed by a daemon thread; ``confirm`` before each write, ``release`` when done."""

    def __init__(
        self,
        store: Path,
        lease: Lease,
        timing: LeaseTiming,
        on_lost: Callable[[], None],
        taken_from: Lease | None,
    ) -> None:
        self.store = store
        self.path = lease_path(store)
        self.lease = lease
        self.timing = timing
        self.taken_from = taken_from  # the stale lease we replaced, if any
        self.lost: str | None = None  # why the lease is no longer ours, once it is not
        self._on_lost = weakref.WeakMethod(on_lost)
        self._lock = threading.Lock()
        self._confirmed = time.monotonic() - max(0.0, lease.age())  # our last heartbeat known to be ours
        self._fd = self._open_own()  # the lease file, for heartbeats in place (None: renew by rename)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"lease-{store.name}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.timing.heartbeat_s):
            try:
                self.renew()
            except OSError as exc:
                log.warning("%s: could not renew the writer lease (%s); retrying", self.path, exc)
            except StoreError:
                log.exception("%s: could not renew the writer lease; retrying", self.path)
            if self.lost is not None:
                callback = self._on_lost()
                if callback is not None:
                    callback()
                return

    def _open_own(self) -> int | None:
        """The lease file opened for writing, if it holds our lease (checked through the descriptor)."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            log.debug(
                "%s: cannot open the lease to renew it in place (%s): renewing by rename", self.path, exc
            )
            return None
        if self._holds_ours(fd):
            return fd
        os.close(fd)
        return None

    def _holds_ours(self, fd: int) -> bool:
        """Whether the file behind ``fd`` is still linked (no lease was renamed over it), with our token."""
        st = os.fstat(fd)
        if st.st_nlink == 0:
            return False
        try:
            current = Lease.from_bytes(os.pread(fd, max(st.st_size, LEASE_BYTES), 0), self.path)
        except StoreError:
            return False
        return current.token == self.lease.token

    def _close_fd(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def _renew_in_place(self, renewed: Lease, started: float) -> bool:
        """The heartbeat of a healthy holder: rewrite the lease through its open descriptor and fsync it, no
        name looked up. Only while our last renewal is younger than half the timeout: nobody may take a
        lease over before its whole timeout, so the file is still ours (``_holds_ours`` checks it anyway).
        False: renew by rename (``renew``), which reads the lease by its name."""
        if self._fd is None or started - self._confirmed >= self.timing.timeout_s / 2:
            return False
        try:
            if not self._holds_ours(self._fd):
                return False
            data = renewed.to_bytes()
            size = os.fstat(self._fd).st_size
            if len(data) < size:  # written by rename with a longer JSON: keep the length
                data = data[:-1].ljust(size - 1) + b"\n"
            os.pwrite(self._fd, data, 0)
            os.fsync(self._fd)  # visible to a taker on another node (NFS flushes on fsync or close)
        except OSError as exc:
            log.warning("%s: renewing the lease in place failed (%s): renewing by rename", self.path, exc)
            return False
        self.lease, self._confirmed = renewed, started
        return True

    def renew(self) -> None:
        """Write a new heartbeat if the lease is still ours; else mark it lost (``self.lost``).

        A healthy holder rewrites the file in place (``_renew_in_place``: no metadata operation but the
        fsync); after a stall, or when that fails, the new lease is written under a temporary name, the
        lease is read by its name, and the new one renamed over it if it is still ours."""
        with self._lock:
            if self.lost is not None:
                return
            started = time.monotonic()
            renewed = replace(self.lease, heartbeat_at=time.time())
            if self._renew_in_place(renewed, started):
                return
            self._close_fd()
            tmp = _write_tmp(self.path, renewed)  # the slow part (fsync) before the check, not after it
            try:
                try:
                    current = _read(self.path)
                except StoreError:  # overwritten with something else: not ours any more either
                    current = None
                if current is None or current.token != renewed.token:
                    self.lost = self._lost_message(current)
                    log.error("%s", self.lost)
                    return
                os.replace(tmp, self.path)
            finally:
                tmp.unlink(missing_ok=True)
            self.lease, self._confirmed = renewed, started
            self._fd = self._open_own()

    def _lost_message(self, current: Lease | None) -> str:
        who = f"it now names {current.describe()}" if current else "its file was removed or overwritten"
        return (
            f"{self.store}: this writer (pid {os.getpid()}) lost its lease {self.path}: {who}. Another "
            f"writer may own the store now (this one missed heartbeats for over {self.timing.timeout_s:g} s: "
            "frozen, or cut off from the file system?); it writes nothing more"
        )

    def confirm(self, force: bool = False) -> None:
        """Before a write: raise :class:`LeaseLost` if the lease is gone. If the last heartbeat we know
        landed is older than half the timeout (a stalled heartbeat thread, a frozen process), renew it
        first: a taker must wait the whole timeout, so a write started within half of it is ours."""
        if self.lost is None and (force or time.monotonic() - self._confirmed > self.timing.timeout_s / 2):
            try:
                self.renew()
            except OSError as exc:
                raise StoreError(f"{self.store}: cannot renew the writer lease {self.path}: {exc}") from exc
        if self.lost is not None:
            raise LeaseLost(self.lost)

    def stop(self) -> None:
        """Stop the heartbeat, leave the file (it goes stale: the holder was dropped without closing)."""
        self._stop.set()
        with self._lock:
            self._close_fd()

    def release(self) -> None:
        """Stop the heartbeat and remove the lease file if it is still ours."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            self._close_fd()
            if self.lost is not None:
                return
            try:
                current = _read(self.path)
                if current is not None and current.token == self.lease.token:
                    self.path.unlink(missing_ok=True)
            except (OSError, StoreError) as exc:
                log.warning("%s: could not remove the writer lease: %s", self.path, exc)


def close_detached(close: Callable[[], None], fd: int) -> None:
    """Run ``close`` (of a file whose lease was lost) with its descriptor ``fd`` pointed at a scratch file:
    HDF5's close writes the superblock and cuts the file to its own idea of the end, which would land on
    the new writer's data; this way it lands in the scratch file."""
    with tempfile.TemporaryFile() as scratch:
        os.dup2(scratch.fileno(), fd)
        try:
            close()
        except Exception as exc:  # only the scratch file is involved
            log.debug("closing a detached file: %s", exc)
