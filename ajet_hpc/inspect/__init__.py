"""Offline inspection of a run: summary, episode tables, conversations token by token, export and plots.

``python -m ajet_hpc.inspect RUN <command>`` reads ``RUN/topology.yaml``, ``RUN/metrics.jsonl`` and the
server stores ``RUN/data/<model>.h5``; it works on a run that is still being written. See :mod:`.cli`.
"""
