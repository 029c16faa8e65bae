"""What runs a model, in the engine's process or in a worker process: the model runner (one packed
forward pass per step and its logits rows)."""
