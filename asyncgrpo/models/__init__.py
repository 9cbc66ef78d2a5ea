"""Models built locally: the tiny Qwen2 with its character tokenizer and supervised warm start
(tiny.py, tokenizer.py, warmstart.py), random-weight models of real shapes with a trained BPE
tokenizer (shapes.py, bpe.py), and the checks of a model directory (check.py). Import the module
you need: this package imports nothing, so naming a shape does not load torch."""
