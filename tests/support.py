"""Helpers shared by the test modules (not fixtures): topologies on disk, waiting, running the CLIs."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]


def topology_dict(run_dir: Path, *, array: int = 3, backend: str = "local", **cluster: Any) -> dict[str, Any]:
    """A small topology: one server on partition gpu, one client group (array) on partition cpu."""
    return {
        "run": {"name": run_dir.name, "dir": str(run_dir)},
        "cluster": {"backend": backend, "signal_delay_s": 30, **cluster},
        "servers": [
            {
                "name": "policy",
                "model": "builtin:tiny",
                "engine": "transformers",  # loads in seconds; the vLLM engine has its own tests
                "trainer": None,  # serve only: these runs test jobs, not training
                "partition": "gpu",
                "gpus_per_node": 0,
                "cpus": 1,
                "mem": "500M",
                "time": "10:00",
            }
        ],
        "clients": [
            {
                "name": "math",
                "agent": "ajet_hpc.environments.arithmetic.agent:solve",
                "tasks": "builtin:arithmetic",
                "servers": ["policy"],
                "partition": "cpu",
                "array": array,
                "max_tasks": 2 * array,  # a finite share of work per array task
                "repeats": 1,
                "cpus": 1,
                "mem": "300M",
                "time": "10:00",
            }
        ],
    }


def write_topology(folder: Path, data: dict[str, Any]) -> Path:
    path = folder / "topology-in.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.5) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(poll_s)


def run_module(module: str, *args: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    """``python -m module args`` with this interpreter, from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def export(run: Path, out: Path, *flags: str, step: int) -> None:
    """``ajet-hpc export RUN --step STEP -o OUT FLAGS``, which must succeed."""
    done = run_module(
        "ajet_hpc.cli", "export", str(run), "--step", str(step), "-o", str(out), *flags, timeout_s=300
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def tied_copy(model_dir: Path, dest: Path, sigma: float = 0.0, seed: int = 2) -> Path:
    """``model_dir`` (an untied model, e.g. builtin:tiny) saved to ``dest`` with its output head tied to the
    input embedding (the shape of Qwen2.5 0.5B-3B and Llama-3.2 1B/3B), every weight moved by N(0, sigma)
    noise; its tokenizer files copied along."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    noise = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=noise) * sigma)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.save_pretrained(dest)
    for extra in [*Path(model_dir).glob("tokenizer*"), Path(model_dir) / "chat_template.jinja"]:
        (Path(dest) / extra.name).write_bytes(extra.read_bytes())
    return Path(dest)


SIGNAL_SAVED = r"signal: (?:checkpoint of step (?=\d+ saved)|step (?=\d+ is already checkpointed))(\d+)"
"""The step a signal's save left checkpointed, in a server log: "signal: checkpoint of step N saved" or
"signal: step N is already checkpointed"; not "step N was not handed to the ranks" nor "waiting for step
N", which name the step in flight (a fast run logs the first of these before its checkpoint line)."""


def recorded_steps(run_dir: Path) -> list[int]:
    """The steps ``metrics.jsonl`` of a run records, in order (event rows left out)."""
    from ajet_hpc.trainer.coordinator import metrics

    return [row["step"] for row in metrics.read_rows(Path(run_dir) / "metrics.jsonl")]


def ranks_trained_steps(run_dir: Path, model: str = "policy") -> Counter:
    """How often the ranks trained each step, over every start (``ranks.log`` is appended to)."""
    text = (Path(run_dir) / "ckpt" / model / "ranks.log").read_text()
    return Counter(int(m) for m in re.findall(r"\[rank 0\] \S+: step (\d+): loss", text))


def jobs_ended(*job_ids: str) -> bool:
    """True once no array task of these Slurm jobs is pending, running or completing."""
    from ajet_hpc.slurm import slurmcli

    return all(s.state not in slurmcli.ACTIVE_STATES for j in job_ids for s in slurmcli.job_states([j]))


@contextlib.contextmanager
def tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """A real file system of ``size`` (e.g. "4m") mounted on ``folder`` (tmpfs; root only): a disk that
    really runs full (ENOSPC). Unmounted on the way out."""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def fill_disk(folder: Path, leave: int = 0) -> Path:
    """A ballast file that leaves about ``leave`` bytes free on ``folder``'s file system; unlink it to give
    the space back."""
    st = os.statvfs(folder)
    ballast = folder / "ballast"
    ballast.write_bytes(bytes(max(0, st.f_bavail * st.f_frsize - leave)))
    return ballast


def zombie(pid: str) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def run_processes(run: Path) -> list[str]:
    """Live processes of the run: those whose command line names a folder of it (every local controller,
    server and client runner does)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(run) in text and not zombie(cmdline.parent.name):
            found.append(f"{cmdline.parent.name}: {text[:160]}")
    return found


# The trainer settings that make every step off-policy: stale episodes allowed, logprobs recomputed.
OFF_POLICY = ("servers.policy.trainer.max_staleness=2", "servers.policy.trainer.recompute_logprobs=true")


def assert_off_policy_metrics(rows: list[dict], share: str) -> None:
    """The engine/trainer gap of every step in its metrics row (docs/algorithms.md, Metrics)."""
    for row in rows:
        assert 0 <= row["mismatch_kl"] < 1, row  # vLLM's kernels never give exactly the trainer's numbers
        assert 0 <= row[share] <= 1 and row["is_ratio_min"] <= row["is_ratio_p50"] <= row["is_ratio_max"]
        assert sum(row["staleness_hist"].values()) == row["samples_before_merge"], row
        assert max(int(lag) for lag in row["staleness_hist"]) <= 2
