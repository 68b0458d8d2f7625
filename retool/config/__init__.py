"""The run's settings: one frozen dataclass per section of luigi.cfg, each field declared once.
Imports nothing else of the project."""
