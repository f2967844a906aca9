"""What every job needs to know about Slurm: its own environment and Slurm's command-line tools.

A package of its own, below everything that runs in a job (server, client, trainer) and the launcher that
submits the jobs, so that none of them has to import another to ask Slurm a question.
"""
