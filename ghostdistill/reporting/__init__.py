"""Reports: one run's results (`results`: JSON, Markdown table, plot) and the multi-plan `compare`."""
