"""A run read offline, from its files: summary, episode tables, conversations token by token, export and
plots (``ajet-hpc inspect``), a trained model as a Hugging Face folder (``ajet-hpc export``), a saved
checkpoint evaluated (``ajet-hpc eval``).

``ajet-hpc inspect RUN <command>`` (or ``python -m ajet_hpc.offline``) reads ``RUN/topology.yaml``,
``RUN/metrics.jsonl`` and the server stores ``RUN/data/<model>.h5``; it works on a run that is still being
written. See :mod:`.cli`. The package was ``ajet_hpc.inspect``, a name that shadowed the standard library's
:mod:`inspect`; the old path still imports, with a warning (``ajet_hpc.moved``).
"""
