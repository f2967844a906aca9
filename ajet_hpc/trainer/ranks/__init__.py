"""The trainer's DeepSpeed ranks: separate processes (torchrun on one node, srun across nodes), one per GPU.

``worker`` is what each rank runs (``python -m ajet_hpc.trainer.ranks.worker``); ``distributed`` who the
rank is and its process group; ``zero`` the DeepSpeed engine, exports and checkpoints; ``lora`` the
adapter under DeepSpeed; ``step`` one optimizer step over the rank's shard; ``weight_sync`` sends the
weights into the engine in memory. Nothing here imports the coordinator's modules: the two sides share
only ``ajet_hpc.trainer.protocol``.
"""
