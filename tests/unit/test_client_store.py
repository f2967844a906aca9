"""The client store on real files: commit, reopen, skip; recovery after truncation, SIGKILL, threads.

Truncation coverage: the journal is cut at *every* byte offset and read back through the recovery path of
``ClientStore.open`` (``read_results``: the same reading and merging, no repair writes); ``ClientStore.open``
itself (repairing both files, then committing on) runs at every interesting offset: each record boundary
-1/0/+1 and the middle of each record. The HDF5 file is cut at every byte of its first KiB, every 61st after.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import h5py
import pytest
from support import fill_disk, tmpfs

from ajet_hpc.storage.client_records import result_payload
from ajet_hpc.storage.client_store import (
    ClientStore,
    CommitFailed,
    Result,
    StoreCorrupt,
    journal_path,
    read_results,
)
from ajet_hpc.storage.client_store_journal import encode_frame
from ajet_hpc.storage.h5_layout import StoreError

GROUP, INDEX = "workers", 3
COMMITS = 20


def make_result(i: int) -> Result:
    """The i-th result of the tests: two repeats per task, some without transcript, one of 3 KB."""
    transcript = (
        None if i % 5 == 0 else f"user: solve {i} (é, 🙂)\nassistant: " + "x" * (3000 if i == 7 else 9 * i)
    )
    return Result(
        task_id=f"task-{i // 2}",
        repeat=i % 2,
        reward=i / 7,
        rewards={"policy": i / 7, "critic": -1.5},
        episode_ids={"policy": f"ep-{i}-p", "critic": f"ep-{i}-c"},
        transcript=transcript,
        metadata={"i": i, "nested": {"list": [1, 2.5, None, "s"]}},
        finished_at=1_700_000_000.0 + i,
    )


def record_ends(data: bytes) -> list[int]:
    """Where each journal record ends (documented frame: magic, u32 length, u32 crc, payload); [0] is the
    header's."""
    ends, offset = [], 0
    while offset < len(data):
        (length,) = struct.unpack_from("<I", data, offset + 4)
        offset += 12 + length
        ends.append(offset)
    assert offset == len(data)
    return ends


def hdf5_task_ids(path: Path) -> list[tuple[str, int]]:
    with h5py.File(path, "r", locking=False) as handle:
        count = int(handle.attrs["committed"])
        assert all(len(handle[name]) == count for name in ("task_id", "repeat", "transcript"))
        return list(zip(handle["task_id"].asstr()[...], handle["repeat"][...].tolist(), strict=True))


class Written:
    """A closed store with COMMITS results, and the bytes of both its files."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / "clients" / GROUP / f"{INDEX}.h5"
        self.journal = journal_path(self.path)
        self.results = [make_result(i) for i in range(COMMITS)]
        with ClientStore.open(self.path, group=GROUP, index=INDEX) as store:
            for result in self.results:
                store.commit(result)
        self.journal_bytes = self.journal.read_bytes()
        self.hdf5_bytes = self.path.read_bytes()
        self.ends = record_ends(self.journal_bytes)
        assert len(self.ends) == COMMITS + 1

    def committed_before(self, cut: int) -> list[Result]:
        """The results whose journal record ends at or before byte ``cut``."""
        return [result for result, end in zip(self.results, self.ends[1:], strict=True) if end <= cut]

    def restore(self, journal_cut: int | None = None, hdf5_cut: int | None = None) -> None:
        """Both files as written, cut where asked; a cut of -1 removes the file."""
        for target, data, cut in (
            (self.journal, self.journal_bytes, journal_cut),
            (self.path, self.hdf5_bytes, hdf5_cut),
        ):
            if cut == -1:
                target.unlink(missing_ok=True)
            else:
                target.write_bytes(data if cut is None else data[:cut])


@pytest.fixture
def written(tmp_path: Path) -> Written:
    return Written(tmp_path)


def names(path: Path) -> str:
    return re.escape(str(path))


# --- the plain path -------------------------------------------------------------------------------------


def test_commit_reopen_and_skip(tmp_path: Path) -> None:
    path = tmp_path / "clients" / GROUP / f"{INDEX}.h5"
    store = ClientStore.open(path, group=GROUP, index=INDEX)
    assert store.path == path and store.committed() == set() and store.results() == []
    for i in range(5):
        store.commit(make_result(i))
    assert store.committed() == {make_result(i).key for i in range(5)}
    store.close()
    store.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        store.commit(make_result(9))

    with ClientStore.open(path, group=GROUP, index=INDEX) as store:
        assert store.results() == [make_result(i) for i in range(5)]  # in commit order, exactly as committed
        todo = [i for i in range(8) if make_result(i).key not in store.committed()]
        assert todo == [5, 6, 7]
        for i in todo:
            store.commit(make_result(i))
    assert [result.key for result in read_results(path)] == [make_result(i).key for i in range(8)]
    assert hdf5_task_ids(path) == [make_result(i).key for i in range(8)]  # the HDF5 view is up to date


def test_duplicate_and_unstorable_commits_are_refused_and_write_nothing(tmp_path: Path) -> None:
    path = tmp_path / "0.h5"
    with ClientStore.open(path, group=GROUP, index=INDEX) as store:
        store.commit(make_result(0))
        size = journal_path(path).stat().st_size
        with pytest.raises(ValueError, match=r"already committed"):
            store.commit(make_result(0))
        bad = Result("t", 0, 1.0, {}, {}, None, {"not json": object()}, 0.0)
        with pytest.raises(TypeError):
            store.commit(bad)
        assert journal_path(path).stat().st_size == size
        store.commit(Result("t", 0, 1, {"m": 1}, {}, None, {}, 5))  # ints stored as floats
    with ClientStore.open(path, group=GROUP, index=INDEX) as store:
        with pytest.raises(ValueError, match=r"already committed"):
            store.commit(make_result(0))
        assert store.results()[1] == Result("t", 0, 1.0, {"m": 1.0}, {}, None, {}, 5.0)


def test_group_or_index_mismatch_names_both(written: Written) -> None:
    with pytest.raises(
        StoreCorrupt, match=rf"{names(written.path)}.*group 'workers' index 3.*group 'other' index 3"
    ):
        ClientStore.open(written.path, group="other", index=INDEX)
    with pytest.raises(StoreCorrupt, match=r"group 'workers' index 3.*group 'workers' index 4"):
        ClientStore.open(written.path, group=GROUP, index=4)


# --- truncation -----------------------------------------------------------------------------------------


def test_journal_cut_at_every_offset_keeps_exactly_the_records_before_the_cut(written: Written) -> None:
    """HDF5 file lost too: the journal alone decides. Below the header's end: StoreCorrupt naming the file."""
    written.path.unlink()
    for cut in range(len(written.journal_bytes) + 1):
        written.journal.write_bytes(written.journal_bytes[:cut])
        if cut < written.ends[0]:
            with pytest.raises(StoreCorrupt, match=rf"{names(written.path)}: the store header is gone"):
                read_results(written.path)
        else:
            assert read_results(written.path) == written.committed_before(cut), cut


def test_open_after_a_journal_cut_repairs_both_files_and_commits_on(written: Written) -> None:
    size = len(written.journal_bytes)
    cuts = {0, 1, written.ends[0] - 1} | {end + step for end in written.ends for step in (-1, 0, 1)}
    cuts |= {(start + end) // 2 for start, end in zip(written.ends, written.ends[1:], strict=False)}
    extra = Result("after-the-cut", 0, 0.5, {}, {}, "t", {}, 1.0)
    for cut in sorted(c for c in cuts if 0 <= c <= size):
        written.restore(journal_cut=cut, hdf5_cut=-1)
        if cut < written.ends[0]:
            with pytest.raises(StoreCorrupt, match=names(written.path)):
                ClientStore.open(written.path, group=GROUP, index=INDEX)
            continue
        expected = written.committed_before(cut)
        with ClientStore.open(written.path, group=GROUP, index=INDEX) as store:
            assert store.results() == expected, cut
            store.commit(extra)
        assert hdf5_task_ids(written.path) == [result.key for result in [*expected, extra]]
        written.path.unlink()  # the repaired journal alone holds everything, the new commit after the rest
        assert read_results(written.path) == [*expected, extra], cut


def test_hdf5_cut_anywhere_is_rebuilt_from_the_journal(written: Written) -> None:
    size = len(written.hdf5_bytes)
    for cut in [*range(1024), *range(1024, size, 61)]:
        written.restore(hdf5_cut=cut)
        assert read_results(written.path) == written.results, cut
    for cut in range(0, size, size // 25):
        written.restore(hdf5_cut=cut)
        with ClientStore.open(written.path, group=GROUP, index=INDEX) as store:
            assert store.results() == written.results
        assert hdf5_task_ids(written.path) == [result.key for result in written.results]


def test_both_files_cut_keep_the_journal_prefix(written: Written) -> None:
    for journal_cut in (written.ends[0], written.ends[6] - 3, written.ends[6], written.ends[6] + 5):
        for hdf5_cut in (0, 700, len(written.hdf5_bytes) // 2, len(written.hdf5_bytes) - 1):
            written.restore(journal_cut, hdf5_cut)
            with ClientStore.open(written.path, group=GROUP, index=INDEX) as store:
                assert store.results() == written.committed_before(journal_cut)


def test_an_intact_hdf5_file_makes_up_for_a_cut_journal(written: Written) -> None:
    for cut in (0, 5, written.ends[0] - 1, written.ends[3], written.ends[3] + 1, written.ends[-1] - 1):
        written.restore(journal_cut=cut)
        assert read_results(written.path) == written.results
    written.restore(journal_cut=written.ends[3] + 1)
    with ClientStore.open(written.path, group=GROUP, index=INDEX) as store:
        assert store.results() == written.results
    written.path.unlink()
    assert read_results(written.path) == written.results  # the journal was rewritten whole


def test_a_lagging_hdf5_file_is_brought_up_to_date(written: Written) -> None:
    with h5py.File(written.path, "r+", locking=False) as handle:
        for name in handle:
            handle[name].resize((10,))
        handle.attrs["committed"] = 10
    assert read_results(written.path) == written.results
    with ClientStore.open(written.path, group=GROUP, index=INDEX) as store:
        assert store.results() == written.results
    assert hdf5_task_ids(written.path) == [result.key for result in written.results]


def test_hdf5_rows_past_the_counter_or_failing_their_checksum_are_dropped(written: Written) -> None:
    with h5py.File(written.path, "r+", locking=False) as handle:
        for name in handle:
            handle[name].resize((COMMITS + 1,))
        handle["task_id"][COMMITS] = "torn"
        handle["reward"][3] = 99.0
    written.journal.write_bytes(written.journal_bytes[: written.ends[5]])  # results 0..4 in the journal
    with ClientStore.open(written.path, group=GROUP, index=INDEX) as store:
        assert store.results() == written.results[:5]  # the journal's; HDF5 row 3 failed its checksum
    assert hdf5_task_ids(written.path) == [result.key for result in written.results[:5]]


def test_header_gone_raises_store_corrupt_naming_the_file(written: Written) -> None:
    for journal_cut in (0, 5, written.ends[0] - 1):
        for hdf5_cut in (-1, 0, 8, 1000):
            written.restore(journal_cut, hdf5_cut)
            with pytest.raises(StoreCorrupt, match=rf"{names(written.path)}: the store header is gone"):
                ClientStore.open(written.path, group=GROUP, index=INDEX)


def test_garbage_files_raise_store_corrupt(written: Written) -> None:
    rng = random.Random(1)
    written.restore(journal_cut=-1)
    written.path.write_bytes(bytes(rng.randrange(256) for _ in range(4096)))
    with pytest.raises(StoreCorrupt, match=names(written.path)):
        ClientStore.open(written.path, group=GROUP, index=INDEX)
    written.restore()
    written.journal.write_bytes(b"#!" + bytes(rng.randrange(256) for _ in range(4096)))
    with pytest.raises(StoreCorrupt, match=rf"{names(written.journal)}: not a client store journal"):
        ClientStore.open(written.path, group=GROUP, index=INDEX)


def test_a_damaged_record_with_records_after_it_is_not_taken_for_a_torn_tail(written: Written) -> None:
    data = bytearray(written.journal_bytes)
    data[written.ends[5] + 20] ^= 0x01
    written.journal.write_bytes(bytes(data))
    written.path.unlink()
    with pytest.raises(
        StoreCorrupt, match=rf"{names(written.journal)}: damaged record at byte {written.ends[5]}"
    ):
        ClientStore.open(written.path, group=GROUP, index=INDEX)


# --- crashes and threads --------------------------------------------------------------------------------

WRITER = """
import sys
from pathlib import Path
sys.path[:0] = [sys.argv[2], str(Path(sys.argv[2]).parent)]  # this folder, and tests/ for support
from test_client_store import GROUP, INDEX, make_result
from ajet_hpc.storage import client_store
from ajet_hpc.storage.client_store import ClientStore

store = ClientStore.open(Path(sys.argv[1]), group=GROUP, index=INDEX)
done = store.committed()
for i in range(100_000):
    if make_result(i).key not in done:
        store.commit(make_result(i))
        print(i, flush=True)
"""


def test_sigkill_mid_commit_loop_loses_no_reported_commit(tmp_path: Path) -> None:
    path = tmp_path / f"{INDEX}.h5"
    reported: set[int] = set()
    rng = random.Random(7)
    for stop_after in (1, 3, 8, 13, 25, 40, 60, 90):
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(path), str(Path(__file__).parent)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert writer.stdout is not None
        seen = 0
        while seen < stop_after:
            line = writer.stdout.readline()
            assert line, f"the writer stopped early: {writer.communicate()[1]}"
            reported.add(int(line))
            seen += 1
        threading.Event().wait(rng.uniform(0, 0.01))
        os.kill(writer.pid, signal.SIGKILL)
        out = writer.stdout.read()  # through the reader readline used: it may hold lines read ahead
        writer.communicate()
        reported |= {int(line) for line in out.split()}
        assert writer.returncode == -signal.SIGKILL
        with ClientStore.open(path, group=GROUP, index=INDEX) as store:
            results = store.results()
        indices = [result.metadata["i"] for result in results]
        assert results == [make_result(i) for i in indices]  # nothing torn
        assert reported <= set(indices)  # every reported commit survived
        assert len(set(indices) - reported) <= 1  # at most the one in flight, durable before its print
        reported = set(indices)


def test_eight_threads_commit_concurrently(tmp_path: Path) -> None:
    path = tmp_path / "0.h5"
    store = ClientStore.open(path, group=GROUP, index=INDEX)
    shared = make_result(10_000)
    outcomes: list[str] = []
    barrier = threading.Barrier(8)

    def work(thread: int) -> None:
        barrier.wait()
        try:
            store.commit(shared)
            outcomes.append("won")
        except ValueError:
            outcomes.append("refused")
        for i in range(10):
            store.commit(make_result(thread * 10 + i))

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    store.close()
    assert sorted(outcomes) == ["refused"] * 7 + ["won"]
    expected = {make_result(i).key for i in range(80)} | {shared.key}
    assert store.committed() == expected
    path.unlink()  # the journal alone: one whole record per commit
    assert sorted(result.key for result in read_results(path)) == sorted(expected)
    assert len(record_ends(journal_path(path).read_bytes())) == 82


def test_group_commits_fsync_once_per_interval_and_the_sync_thread_catches_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four threads commit 400 results as fast as they can: the journal is fsynced about once per
    ``sync_interval_s`` (counted at os.fsync), at most 0.1 times per result; a lone commit afterwards is
    fsynced by the sync thread within the interval, not left for close; all 401 read back.

    ``os.fsync`` is wrapped, not replaced: every call still reaches the kernel, the wrapper only counts the
    calls on the journal's descriptor (checking the store's own ``fsyncs``). No real part reports them to a
    test: the kernel keeps no count of a file's fsyncs, and tracing the process (strace, as
    tools/bench/scale.py does for a whole client task) is not a dependency of the unit tests."""
    path = tmp_path / "0.h5"
    synced: list[int] = []
    real_fsync = os.fsync
    store = ClientStore.open(path, group=GROUP, index=INDEX, sync_interval_s=0.5)

    def counted(fd: int) -> None:
        if fd == store._journal_fd:
            synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counted)
    started = time.monotonic()

    def work(thread: int) -> None:
        for i in range(100):
            store.commit(make_result(thread * 100 + i))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    assert len(synced) == store.fsyncs <= min(40, elapsed / 0.5 + 2), (len(synced), elapsed)
    before = store.fsyncs
    store.commit(make_result(1000))
    deadline = time.monotonic() + 5
    while store.fsyncs == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.fsyncs == before + 1 and len(synced) == store.fsyncs  # by the sync thread
    store.close()
    assert len(synced) == store.fsyncs  # nothing left unsynced for close
    with ClientStore.open(path, group=GROUP, index=INDEX) as again:
        assert len(again.results()) == 401


def test_a_failed_append_leaves_no_torn_record(tmp_path: Path) -> None:
    """A real full disk (a 4 MiB tmpfs filled by a ballast file) under a journal whose last page is partly
    used: the kernel writes the record's first bytes into that page, then refuses the next one (ENOSPC). The
    torn record is cut off, the store refuses commits until it is reopened, and once space is back the
    reopened store holds the earlier results and takes the failed one."""
    with tmpfs(tmp_path / "disk", "4m") as disk:
        path = disk / "0.h5"
        store = ClientStore.open(path, group=GROUP, index=INDEX)
        for i in range(3):
            store.commit(make_result(i))
        size = journal_path(path).stat().st_size
        big = replace(make_result(3), transcript="y" * 6000)
        page = os.statvfs(disk).f_frsize
        assert (
            size % page > 0 and len(encode_frame(result_payload(big))) > page
        )  # a write that starts and cannot end
        ballast = fill_disk(disk, 0)
        with pytest.raises(CommitFailed, match="No space left on device"):
            store.commit(big)
        assert journal_path(path).stat().st_size == size
        with pytest.raises(CommitFailed, match="reopen"):
            store.commit(make_result(4))
        ballast.unlink()
        store.close()
        with ClientStore.open(path, group=GROUP, index=INDEX) as store:
            assert store.results() == [make_result(i) for i in range(3)]
            store.commit(big)
        assert [result.key for result in read_results(path)] == [make_result(i).key for i in range(4)]


EFBIG_WRITER = """
import json, logging, resource, signal, sys
from dataclasses import replace
from pathlib import Path
sys.path[:0] = [sys.argv[2], str(Path(sys.argv[2]).parent)]  # this folder, and tests/ for support
from test_client_store import GROUP, INDEX, make_result
from ajet_hpc.storage.client_store import ClientStore, journal_path

logging.basicConfig(level=logging.INFO)
path = Path(sys.argv[1])
results = [replace(make_result(i), transcript=f"{i} " + "z" * 20_000) for i in range(3)]
with ClientStore.open(path, group=GROUP, index=INDEX) as store:
    store.commit(results[0])
    limit = path.stat().st_size
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    store.commit(results[1])  # durable in the journal: the commit stands
    store.commit(results[2])
    sizes = {"limit": limit, "journal": journal_path(path).stat().st_size, "view": path.stat().st_size}
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    sizes["committed"] = sorted(map(list, store.committed()))
print(json.dumps(sizes), flush=True)
"""


def test_a_failed_hdf5_append_keeps_the_commit_and_the_view_is_rebuilt(tmp_path: Path) -> None:
    """A real write failure of the HDF5 view after its journal record was written: a file size limit
    (RLIMIT_FSIZE, as ``ulimit -f`` sets it) at the view's size, so that the journal, smaller, still grows and
    the view, which must grow to hold a 20 KB transcript, gets EFBIG. The commits stand and the view is
    rebuilt from the journal on close. SIGXFSZ, which the kernel sends with EFBIG, is ignored.

    The writer is a process of its own: the limit holds for every file its process writes (here it would
    reach the other tests' threads), and the view it lets go of stays open until its process exits
    (``client_store_view.Hdf5View.let_go``), where h5py reports the handle it cannot release."""
    path = tmp_path / "0.h5"
    results = [replace(make_result(i), transcript=f"{i} " + "z" * 20_000) for i in range(3)]
    done = subprocess.run(
        [sys.executable, "-c", EFBIG_WRITER, str(path), str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0 and done.stdout, done.stderr[-3000:]
    sizes = json.loads(done.stdout.splitlines()[0])
    assert sizes["journal"] < sizes["limit"] and sizes["view"] <= sizes["limit"]  # the limit stopped the view
    assert "HDF5 view fell behind" in done.stderr and "File too large" in done.stderr
    assert sorted(map(tuple, sizes["committed"])) == sorted(result.key for result in results)
    assert hdf5_task_ids(path) == [result.key for result in results]  # rebuilt on close
    assert read_results(path) == results


def test_a_second_open_of_a_store_in_the_same_process_is_refused_and_the_first_keeps_working(
    tmp_path: Path,
) -> None:
    """The lease would take its own process's claim over (its rule for a writer left unclosed) and the two
    writers' records would then make the store unopenable; the second open is refused by name instead."""
    path = tmp_path / "c.h5"
    with ClientStore.open(path, group=GROUP, index=INDEX) as first:
        first.commit(make_result(0))
        with pytest.raises(StoreError, match="already open in this process"):
            ClientStore.open(tmp_path / "." / "c.h5", group=GROUP, index=INDEX)
        first.commit(make_result(1))
    with ClientStore.open(path, group=GROUP, index=INDEX) as again:  # closed: it opens again
        assert again.committed() == {make_result(0).key, make_result(1).key}
