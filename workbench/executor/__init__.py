"""Executors: where a step's forward pass runs. The engine hands an executor the step's inputs and
gets the logits rows back, without knowing whether the model is in its own process
(uniproc.py) or sharded over worker processes on torch.distributed (distributed.py: the driver's
side; worker.py: a worker's loop; launch.py: under torchrun)."""
