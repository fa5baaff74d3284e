"""Calibration: stream windows through the dense model into every method's statistics (`stream`),
then solve every gap of every method into views (`fit`).

Why `pipeline/calibrate.py` is not here: this package is the arithmetic of calibration on the batches it
is given (one pass into float64 sums, the solves, the sums across ranks); it knows no run. Choosing the plan,
resuming from `calibration_state.pt`, checkpointing it and timing the parts is orchestration of a run, which
`pipeline` holds (it may import `planning`, which sits above this package).
"""
