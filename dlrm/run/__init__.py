"""A training run, read top to bottom in loop.py (`train`): set-up and `--resume` (setup), what a run is
made of and what changes while it goes on (state), val evaluations, best.pt and the test evaluation
(selection), last.pt and best.pt (checkpoints), the non-finite guard (nonfinite), the run directory
(directory), and the one object that owns every difference between one process and many ranks (strategy).
"""
