"""CAMELoT's store (seed 001): the training-free associative memory of a frozen model
(`memory.py`) and the caches of its baselines. training/camelot/ hooks it into a model; memstore's
core never imports this folder."""
