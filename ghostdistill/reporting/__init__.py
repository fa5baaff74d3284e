"""Reports: one run's results (`results`: JSON, Markdown table, plot) and the multi-plan `compare`.

`frontier` and `analysis` write those reports' files; what they report is computed elsewhere
(`pipeline.frontier` runs the depths, `analysis` computes the anatomy): reporting sits above every phase and
only presents.
"""
