"""Reports: one run's results (`results`: JSON, Markdown table, plot) and the multi-plan `compare`.

`frontier` and `analysis` write those reports' files; what they report is computed elsewhere (`pipeline.frontier`
runs the depths, `analysis` computes the anatomy): reporting sits above every phase and only presents.
"""

import csv
import io
from contextlib import contextmanager

from ..core.io import atomic_savefig


def csv_text(rows: list[dict]) -> str:
    """`rows` as CSV, a column per key of the first row."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


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
