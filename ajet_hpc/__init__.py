"""ajet_hpc: a Slurm framework for reinforcement learning of LLM agents."""
