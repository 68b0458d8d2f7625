"""Running the model's code: one fresh, contained process per call."""
