"""What the coordinator puts in the environment of the ranks it starts, besides the weight-sync plan
(``sync_plan``) and the resume limit (``checkpoints.RESUME_LIMIT_VAR``): who started them, and free ports for
their rendezvous (torchrun's ``MASTER_PORT`` across nodes, rank 0's gloo transfer group)."""

from __future__ import annotations

import socket

PARENT_PID_VAR = "AJET_TRAINER_PARENT_PID"
PARENT_HOST_VAR = "AJET_TRAINER_PARENT_HOST"
"""The starting process (the coordinator) and its host: rank 0 exits when that process is gone."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]
