"""The file protocol between the coordinator (``ajet_hpc.trainer.coordinator``, in the server process) and the
DeepSpeed ranks (``ajet_hpc.trainer.ranks``): imported by both sides, importing neither."""
