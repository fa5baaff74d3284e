"""The model-level core: loading and the decoder stack, the pruning plan, the views that share one set
of blocks, the gap operator, residual-stream capture, float64 solvers and atomic files.

Nothing here imports from any other subpackage of ghostdistill: every layer above builds on it.
"""
