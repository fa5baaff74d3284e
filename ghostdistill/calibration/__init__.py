"""Calibration: stream windows through the dense model into every method's statistics (`stream`),
then solve every gap of every method into views (`fit`)."""
