"""The finetuning systems' experiments: learning new facts without forgetting by sparse memory
finetuning, full and LoRA (`continual.py`, seed 003, `memtree eval continual`) and memory adapters
(`adapters.py`, seed 004 §7.3, `memtree eval adapters`). eval's core never imports this folder."""
