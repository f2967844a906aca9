"""The trainer: DeepSpeed ZeRO rank processes next to a server's engine, driven through files.

``coordinator`` drives the steps from inside the server process; ``host`` is its seam with that server (what
it needs from it, `TrainerHost`, and what it is built with, `TrainerSetup`); ``sync_plan`` decides once how
weights reach the engine. ``rank_files`` is the file protocol between the coordinator and the ranks, with
the coordinator's side of it (:class:`~ajet_hpc.trainer.protocol.rank_files.TrainerChannel`);
starts the ranks (torchrun on one node, srun across nodes); ``worker`` is what each rank runs.
"""
