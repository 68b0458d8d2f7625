"""What a stage runs with: the run's set-up, once per command, and what the jobs of a process share."""
