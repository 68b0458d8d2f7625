"""Training: one PPO or supervised step, its micro-batches and losses, the memory plan, the cold start, checkpoints."""
