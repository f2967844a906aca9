"""The trainer: DeepSpeed ZeRO rank processes next to a server's engine, driven through files.

Two processes, one package each: ``coordinator`` runs in the server process (the training loop, its seam with
the server, the collector, the rank launcher, the step's records), ``ranks`` in each DeepSpeed rank started by
it (``python -m ajet_hpc.trainer.ranks.worker``). They share only ``protocol``: the files of the work dir
between them, the weight-sync plan and control channel, the ranks' environment. Neither side imports the
other (``tests/unit/test_import_layers.py``).
"""
