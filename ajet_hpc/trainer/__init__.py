"""The trainer: DeepSpeed ZeRO rank processes next to a server's engine, driven through files.

``protocol`` is the file protocol between the coordinator (HTTP front + engine) and the ranks, with the
coordinator's side of it (:class:`~ajet_hpc.trainer.rank_files.TrainerChannel`); ``launch`` starts the ranks
(torchrun on one node, srun across nodes); ``worker`` is what each rank runs.
"""
