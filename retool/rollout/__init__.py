"""The multi-turn rollout: its state machine, its replay from a step's files, and PPO datums. No torch."""
