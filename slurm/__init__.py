"""Slurm: the sbatch scripts and `layertap submit`, which sizes job arrays from a run's unfinished shards."""
