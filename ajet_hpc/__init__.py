"""ajet_hpc: a Slurm framework for reinforcement learning of LLM agents."""

from ajet_hpc import moved

moved.install()
