"""Reports: one run's results (`results`: JSON, Markdown table, plot) and the multi-plan `compare`.

`frontier` and `analysis` write those reports' files; what they report is computed elsewhere
(`pipeline.frontier` runs the depths, `analysis` computes the anatomy): reporting sits above every phase and
only presents.
"""

from contextlib import contextmanager

from ..core.io import atomic_savefig


@contextmanager
def figure(path, *args, **kwargs):
    """`(fig, axes)` of `plt.subplots(*args, **kwargs)` on matplotlib's file-only backend (Agg), written to
    `path` (atomically) when the block ends, then closed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*args, **kwargs)
    try:
        yield fig, axes
        atomic_savefig(fig, path)
    finally:
        plt.close(fig)
