"""The file protocol between the coordinator (``ajet_hpc.trainer.coordinator``, in the server process) and the
DeepSpeed ranks (``ajet_hpc.trainer.ranks``): imported by both sides, importing neither.

Everything lives in one work dir on shared storage (``RUN/ckpt/<model>/``, `work_dir.WorkDir`); every file is
written to a temporary name and renamed, so a reader sees a whole file or none:

``inbox/step-000001.pt`` (``batch_file``)
    A batch, written by the coordinator: the step, whether to checkpoint it, and its samples, the per-token
    fields of all samples as one tensor each. Rank 0 deletes it once the step's result is written.
``outbox/step-000001.json`` (``step_result``)
    The result, written by rank 0 after the optimizer step and the weight hand-off: a `StepResult` as flat
    JSON (``{"step", "loss", "kl", "entropy", "clip_frac", "grad_norm", "tokens", "samples", "step_time_s",
    "export_time_s", "checkpoint", "checkpoint_time_s", "off_policy", "weights"}`` with ``"weights": "disk"``
    and ``"weights_dir"``, ``"weights": "memory"``, ``"sync_send_s"`` and ``"sync_bytes"``, or ``"weights":
    "withheld"`` when the server's job was ending and the in-memory send stopped: ``weight_handoff``); or
    ``{"step", "error"}`` when the step failed (the ranks then exit).
``weights/step-000001/`` (``weight_handoff``)
    The full model as ``save_pretrained`` writes it, plus the initial model's tokenizer files: what the
    engine reloads. The last ``KEEP_WEIGHTS`` folders are kept.
``ds/step-000001/``, ``ds/latest``, ``ds/trainer_state.json`` (``checkpoints``)
    DeepSpeed checkpoints (``engine.save_checkpoint(ds, tag="step-000001")``) and, written after the
    checkpoint is complete, the trainer state naming the last complete one (and, as ``previous``, the
    one before it, kept). Only the tag named in ``trainer_state.json`` is trusted (DeepSpeed's ``latest``
    may name a half-written one). Ranks started with ``AJET_RESUME_AT_MOST`` (the last step the coordinator
    recorded) go back to ``previous`` from a trusted checkpoint past it (`checkpoints.resume_point`).
``ready.json``
    Written by rank 0 once the ranks are up: ``{"step": the last trained step (0 when fresh), ...}`` and,
    when resumed, how that step's weights reached the engine (the fields of the hand-off, as in a result);
    the next batch to submit is ``step + 1``. ``{"error"}`` when a rank failed to start.
``stop``
    Created by the coordinator: the ranks exit at their next wait for a batch.
``save-request.json``
    Written by the coordinator on Slurm's pre-timeout/preemption signal: ``{"step": n}``. At their next
    wait for a batch, the ranks (then at step ``n``) save a checkpoint of step ``n`` unless the trusted one
    already is, and rank 0 removes the request; a request for another step is refused in
    ``save-refused.json``.
``sync/`` (``sync_channel``)
    The control calls of an in-memory weight sync, from rank 0 to the server's engine, and the
    ``engine-up`` and ``job-ending`` markers.

Steps are 1, 2, 3, ... with no gaps: after resuming at step ``n`` the ranks wait for ``n + 1``, and first
remove the weights, checkpoints and results an abandoned run left for steps after ``n``
(`work_dir.discard_after`).

How the weights reach the engine is decided once by the server (``sync_plan``) and handed to the ranks in
their environment, with the variables of ``rank_env``. The coordinator's handle on all this is
``ajet_hpc.trainer.coordinator.channel.TrainerChannel``; the ranks' is ``ajet_hpc.trainer.ranks.worker``.
"""
