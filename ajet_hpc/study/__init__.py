"""Studies: many runs of one base topology over a search space, kept going by a supervisor (docs/study.md)."""
