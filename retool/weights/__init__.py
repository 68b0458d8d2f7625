"""The models a run starts from and the checkpoints it writes."""
