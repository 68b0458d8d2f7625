"""The chat protocol: prompts rendered with the model's template, the code_interpreter tool and its calls."""
