"""Evaluation: per-token metrics (`metrics`), zero-shot accuracy through lm-eval (`zeroshot`, with the
offline task definitions in `tasks/`) and the resumable store of zero-shot scores (`scores`)."""
