"""`asyncgrpo study`: grids of training runs x seeds, run on one machine, with a statistical report."""
