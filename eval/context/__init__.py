"""The context bank's experiment (seed 004 §9): cross-session recall through the bank on a bios
demo run's frozen anchor (`recall.py`, `memtree eval context-bank`). eval's core never imports
this folder."""
