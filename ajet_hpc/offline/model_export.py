"""``ajet-hpc export RUN [--model NAME] [--step N] -o DIR [--adapter]``: a trained model as a Hugging Face
folder that ``transformers`` and ``vllm serve`` load as they are.

The weights come from a trainer checkpoint (``RUN/ckpt/<model>/ds/step-N``, the newest committed one by
default), consolidated on the CPU by DeepSpeed's own ``zero_to_fp32`` from any ZeRO stage and rank count.
The folder holds safetensors, ``config.json`` and the initial model's tokenizer files and chat template,
in the initial model's dtype. A LoRA model (``trainer.lora``) is merged into its base by default
(``merge_and_unload``); ``--adapter`` writes the peft adapter folder instead (load it with
``PeftModel.from_pretrained`` or vLLM's ``--lora-modules``).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

from ajet_hpc.config import ConfigError, ServerConfig
from ajet_hpc.engine.adapter import peft_config
from ajet_hpc.engine.model_path import offline_hub, resolve_model
from ajet_hpc.storage.rundir import RunDir
from ajet_hpc.trainer.protocol.checkpoints import read_trainer_state
from ajet_hpc.trainer.protocol.weight_handoff import copy_model_extras
from ajet_hpc.trainer.protocol.work_dir import WorkDir, step_name

log = logging.getLogger(__name__)


class ExportError(Exception):
    """The run has no such model or checkpoint, or the output folder is in the way."""


def trained_server(run: RunDir, name: str | None) -> ServerConfig:
    """The run's trainable server ``name``, or its only one."""
    if not run.exists():
        raise ExportError(f"{run.root} is not a run directory (no {run.topology_file.name})")
    trained = [s for s in run.load_topology().models if s.trainer is not None]
    names = ", ".join(s.name for s in trained) or "(none)"
    if name is None:
        if len(trained) != 1:
            raise ExportError(f"the run trains {len(trained)} models ({names}): name one with --model")
        return trained[0]
    for server in trained:
        if server.name == name:
            return server
    raise ExportError(f"the run trains no model named {name!r}; it trains: {names}")


def checkpoint_tag(work: WorkDir, step: int | None) -> tuple[str, int]:
    """The DeepSpeed tag of ``step`` (default: the newest committed checkpoint) and its step."""
    state = read_trainer_state(work)
    if step is None:
        if state is None:
            raise ExportError(f"{work.ds} holds no committed checkpoint yet")
        return state.tag, state.step
    tag = step_name(step)
    if not (work.ds / tag).is_dir():
        found = sorted(p.name for p in work.ds.glob("step-*")) if work.ds.is_dir() else []
        raise ExportError(
            f"no checkpoint of step {step} in {work.ds}; there are: {', '.join(found) or '(none)'}"
        )
    return tag, step


def export(
    run_dir: Path, out: Path, model: str | None = None, step: int | None = None, adapter: bool = False
):
    """Write the folder (see the module doc); returns (server name, step)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ajet_hpc.trainer.ranks.distributed import import_deepspeed

    import_deepspeed()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    run = RunDir(Path(run_dir))
    server = trained_server(run, model)
    assert server.trainer is not None
    lora = server.trainer.lora
    if adapter and lora is None:
        raise ExportError(
            f"{server.name} trains all its weights (no trainer.lora): export it without --adapter"
        )
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out} exists and is not empty: choose a new folder")
    work = WorkDir(run.trainer_dir(server.name))
    tag, at = checkpoint_tag(work, step)
    base_dir = resolve_model(server.engine.model, run.models_dir)
    offline_hub()
    started = time.monotonic()
    trained = get_fp32_state_dict_from_zero_checkpoint(str(work.ds), tag=tag)
    net: Any = AutoModelForCausalLM.from_pretrained(base_dir, dtype="auto", local_files_only=True)
    dtype = net.dtype
    if lora is not None:
        from peft import get_peft_model

        net = get_peft_model(net, peft_config(lora))
    missing, unexpected = net.load_state_dict({k: v.to(dtype) for k, v in trained.items()}, strict=False)
    if unexpected:
        raise ExportError(f"checkpoint {work.ds / tag} holds tensors the model lacks: {unexpected[:5]}")
    if lora is not None:  # the base's tensors come from the model folder, the adapter's from the checkpoint
        lacking = [k for k in missing if ".lora_" in k]
    else:  # a tied head is the embedding's tensor: loaded under the embedding's name
        params = dict(net.named_parameters(remove_duplicate=False))
        loaded = {params[k].data_ptr() for k in trained if k in params}
        lacking = [k for k in missing if k in params and params[k].data_ptr() not in loaded]
    if lacking:
        raise ExportError(f"checkpoint {work.ds / tag} lacks tensors of the model: {lacking[:5]}")
    out.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        if adapter:
            net.save_pretrained(out, safe_serialization=True, save_embedding_layers=False)
        else:
            if lora is not None:
                net = net.merge_and_unload()
            net.save_pretrained(out, safe_serialization=True)
    copy_model_extras(base_dir, out)
    log.info("exported %s step %d to %s in %.1f s", server.name, at, out, time.monotonic() - started)
    return server.name, at


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="the run directory")
    parser.add_argument("--model", help="the trained model (server) to export; default: the run's only one")
    parser.add_argument("--step", type=int, help="the checkpoint's step; default: the newest committed one")
    parser.add_argument("-o", "--output", type=Path, required=True, help="the folder to write (new or empty)")
    parser.add_argument(
        "--adapter", action="store_true", help="a LoRA model as its peft adapter folder, not merged"
    )
    return parser


def main(argv: list[str] | None = None, prog: str = "ajet-hpc export") -> int:
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        name, step = export(args.run, args.output, args.model, args.step, args.adapter)
    except (ExportError, ConfigError) as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return 2
    kind = "adapter" if args.adapter else "model"
    print(f"{name} step {step}: {kind} folder written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
