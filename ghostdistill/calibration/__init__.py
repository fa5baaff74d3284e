"""Calibration: stream windows through the dense model into every method's statistics (`stream`),
then solve every gap of every method into views (`fit`); the statistics saved while they accumulate, keyed
and checked on load (`state`: calibration_state.pt).

Why `pipeline/calibrate.py` is not here: this package is the arithmetic of calibration on the batches it
is given (one pass into float64 sums, the solves, the sums across ranks) and its saved state; it knows no run.
Choosing the plan (`planning`, which sits above this package: its repair-aware criterion calibrates) and a
run's key, then resuming and checkpointing in that order, is the phase, which `pipeline` holds.
"""
