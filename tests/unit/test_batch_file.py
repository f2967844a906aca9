"""The batch file the coordinator hands the ranks: per-token fields as 64-bit tensors (fast to write and
read at real batch sizes), read back as exactly the samples written; the former layout (every field a
list, ``dataclasses.asdict``) is the reference."""

from __future__ import annotations

import dataclasses
import io
import random
from pathlib import Path

import torch

from ajet_hpc.algo.sample_tensors import Sample
from ajet_hpc.trainer.protocol.batch_file import encode_batch, read_batch, write_batch
from ajet_hpc.trainer.protocol.work_dir import WorkDir


def random_sample(rng: random.Random, index: int) -> Sample:
    n = rng.randint(1, 40)
    mask = [0] + [rng.choice((0, 1)) for _ in range(n - 1)]
    tree = rng.random() < 0.3
    return Sample(
        token_ids=[rng.randrange(200_000) for _ in range(n)],
        loss_mask=mask,
        old_logprobs=[-rng.expovariate(0.5) if m else 0.0 for m in mask],
        advantages=[rng.uniform(-3, 3) if m else 0.0 for m in mask],
        policy_version=rng.randrange(5),
        episode_id=f"ep{index}",
        task_id=f"t{index % 3}",
        weight=rng.choice((1.0, 0.1 + rng.random())),
        weights=[rng.random() for _ in range(n)] if rng.random() < 0.3 else None,
        parents=[i - 1 for i in range(n)] if tree else None,
        calls=sorted(rng.sample(range(10), rng.randint(0, 3))),
    )


def reference_bytes(step: int, samples: list[Sample], save: bool) -> bytes:
    """The former batch file: every field as ``dataclasses.asdict`` gives it."""
    buffer = io.BytesIO()
    payload = {"step": step, "samples": [dataclasses.asdict(s) for s in samples], "save_checkpoint": save}
    torch.save(payload, buffer)
    return buffer.getvalue()


def test_batch_files_read_back_exactly_and_the_former_layout_still_reads(tmp_path: Path) -> None:
    rng = random.Random(17)
    work = WorkDir(tmp_path)
    for step in range(1, 21):
        samples = [random_sample(rng, i) for i in range(rng.randint(1, 12))]
        save = rng.random() < 0.5
        batch = read_batch(write_batch(work, step, samples, save))
        assert (batch.step, batch.save_checkpoint, batch.samples) == (step, save, samples)
        assert all(type(t) is int for s in batch.samples for t in s.token_ids)  # lists of Python numbers
        made_before = encode_batch(step, samples, save)  # what the coordinator encodes while a step trains
        assert read_batch(write_batch(work, step, samples, save, encoded=made_before)).samples == samples
        work.batch_file(step).write_bytes(reference_bytes(step, samples, save))
        assert read_batch(work.batch_file(step)).samples == samples


def test_a_batch_is_written_without_crc32_and_torch_s_setting_is_left_as_it_was(tmp_path: Path) -> None:
    import zipfile

    samples = [random_sample(random.Random(3), i) for i in range(4)]
    assert torch.serialization.get_crc32_options() is True
    data = encode_batch(1, samples, False)
    assert torch.serialization.get_crc32_options() is True  # other saves of the process keep their CRC
    with zipfile.ZipFile(io.BytesIO(data)) as archive:  # torch's zip: the records carry no checksum
        assert {info.CRC for info in archive.infolist() if info.file_size} == {0}
    assert read_batch(write_batch(WorkDir(tmp_path), 1, samples, False, encoded=data)).samples == samples
    buffer = io.BytesIO()
    torch.save({"x": torch.ones(3)}, buffer)  # a save outside encode_batch still has them
    with zipfile.ZipFile(buffer) as archive:
        assert any(info.CRC for info in archive.infolist() if info.file_size)
