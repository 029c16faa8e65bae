"""Parallelism on torch.distributed, as transformations of one model: tensor (tensor.py), sequence
(sequence.py), pipeline (pipeline.py) and expert (moe.py) parallel shards, the rank layout
(layout.py) and the counted collectives between shards (comm.py). The processes that hold the
shards and the driver that posts them steps are in workbench/executor/."""
