"""CAMELoT's experiment (seed 001): long-context perplexity of a frozen anchor with base / XL /
Memorizing / CAMELoT memories (`longctx.py`, `memtree eval longctx`). eval's core never imports
this folder."""
