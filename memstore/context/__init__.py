"""The context bank's store (seed 004 §9): the runtime memory written at inference time and kept
across sessions (`bank.py`). training/context/ holds its compressor; memstore's core never imports
this folder."""
