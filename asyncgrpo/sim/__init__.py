"""`asyncgrpo simulate`: a discrete-event model of a run, calibrated from its own measured phase times."""
