"""Running model-written code: limits on CPU, memory, wall time, file size and processes, no network, a
private temporary dir (``runner`` says how). Agents of code tasks call ``run_python``."""

from ajet_hpc.environments.sandbox.limits import Limits, Result
from ajet_hpc.environments.sandbox.runner import SandboxUnavailable, isolation_in_use, run_python

__all__ = ["Limits", "Result", "SandboxUnavailable", "isolation_in_use", "run_python"]
