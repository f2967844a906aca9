"""Turning a topology into jobs: plan, backends (slurm, hetjob, local), and the job registry."""
