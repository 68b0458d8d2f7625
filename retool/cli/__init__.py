"""The command-line tools: `python -m retool COMMAND` (see retool/__main__.py)."""
