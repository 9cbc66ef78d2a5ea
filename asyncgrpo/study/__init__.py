"""`asyncgrpo study`: grids of training runs x seeds, run on one machine, with a statistical report.

spec.py (the spec file and its plan of runs), runner.py (running them, resumably; the command),
cluster.py (the Ray cluster whose engines the runs keep), results.py (what the runs left behind),
stats.py (intervals, paired differences), report.py (results.csv, report.md), plots.py (figures).
"""
