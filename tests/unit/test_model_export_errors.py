"""``ajet-hpc export``'s refusals, through the real CLI on a real run directory (its frozen topology written
as the launcher writes it): exit 2 with the reason, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

from ajet_hpc.cli import main
from ajet_hpc.config import dump_topology, load_topology


def run_dir(tmp_path: Path, lora: bool) -> Path:
    trainer = {"lora": {"rank": 8}} if lora else {}
    topology = load_topology(
        {
            "run": {"name": "x"},
            "servers": [
                {"name": "policy", "model": "builtin:tiny", "trainer": trainer},
                {"name": "judge", "model": "builtin:tiny", "trainer": None},
            ],
        }
    )
    root = tmp_path / "run"
    root.mkdir()
    (root / "topology.yaml").write_text(dump_topology(topology))
    return root


@pytest.mark.parametrize(
    "args,lora,message",
    [
        (["--model", "judge"], False, "the run trains no model named 'judge'; it trains: policy"),
        ([], False, "holds no committed checkpoint yet"),
        (["--step", "3"], False, "no checkpoint of step 3"),
        (["--adapter"], False, "trains all its weights (no trainer.lora): export it without --adapter"),
    ],
)
def test_export_refuses_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], lora: bool, message: str
) -> None:
    out = tmp_path / "out"
    assert main(["export", str(run_dir(tmp_path, lora)), "-o", str(out), *args]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_export_of_a_folder_that_is_no_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", str(tmp_path), "-o", str(tmp_path / "out")]) == 2
    assert "is not a run directory" in capsys.readouterr().err
