"""The trainer's side that runs in the server process, next to the HTTP front and the engine.

``loop`` is the training loop (`Coordinator`); ``host`` its seam with the server that hosts it. Per step:
``collector`` makes batches of finished episodes, ``episodes_to_samples`` turns them into samples,
``journal`` names the episodes a step consumed, ``metrics`` and ``experiment_trackers`` record the step.
``rank_launcher`` starts the DeepSpeed ranks (``ajet_hpc.trainer.ranks``); ``recovery`` rebuilds the
episode state of a restarted server from its store; ``evaluation`` runs the eval rounds between steps;
``algorithm_settings`` fills in a trainer's algorithm defaults. Nothing here imports the ranks' modules:
the two sides share only ``ajet_hpc.trainer.protocol``.
"""
