"""Luigi tasks of the ReTool pipeline: `luigi --module pipeline <Task> --step N`."""

import pipeline.errors  # noqa: F401  (input errors as one line)
from pipeline.config import SECTIONS  # noqa: F401  (the settings' Luigi config sections)
from pipeline.tasks import (  # noqa: F401
    BeforeAfter,
    BuildDatums,
    ColdStart,
    Evaluate,
    ExecuteRound,
    Prompts,
    Report,
    SampleRound,
    ScoreTrajectories,
    SFTExamples,
    TrainStep,
)
