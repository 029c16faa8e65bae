"""Model compression beyond quantization: pruning by masks (pruning.py), structured pruning that
removes layers or MLP channels (structured.py), and distillation that trains a pruned student
back toward its teacher (distill.py, with losses.py, train_forward.py and the shared trainer.py)."""
