"""The draft trainer (``vat train``): the training loop (trainer.py), its data (data.py, defaults.py), resumable
checkpoints (checkpointing.py), world-size independent reductions (distributed.py), LoRA (lora.py) and the drafter
kinds it builds (kinds/)."""
