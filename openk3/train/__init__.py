"""Pre-training: data.py (corpus, packing), optim.py (Muon + AdamW, QK-Clip), balance.py (Quantile Balancing of
the router bias), trainer.py (the loop, checkpoints of a run, `openk3 train` / `openk3 eval`), plots.py."""
