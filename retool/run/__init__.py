"""What a stage runs with: a run's set-up, once per process, and each task's context."""
