"""The frontier draw: a step's questions chosen by how often earlier steps got them right, favouring those whose
group of samples is likely to disagree (GRPO learns nothing from a group all right or all wrong).

Each question's pass rate is estimated from the trajectories of earlier steps: its own samples where it recurs,
shrunk toward its family's (`data_source`) rate, and the family's rate toward 1/2 (Laplace), so an unseen family
starts at 1/2. Its draw weight is the chance that a group of `group_size` samples at that rate disagrees,
1 - p^G - (1 - p)^G, at least `floor`; the step's questions are drawn without replacement in proportion to it
by a generator seeded with the run's seed and the step, so the same files give the same draw."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from retool.data.examples import MathExample

FAMILY_PRIOR_SAMPLES = 2  # the family's rate counts as this many samples of a question's own


@dataclass(frozen=True)
class Draw:
    example: MathExample  # the question drawn
    pass_rate: float | None  # the estimate it was drawn by; None: drawn in the shuffled order
    weight: float | None  # its draw weight (chance its group disagrees, at least the floor); None as pass_rate
    reason: str  # where the estimate came from, for prompts.parquet


@dataclass(frozen=True)
class Tally:
    right: int = 0  # samples answered correctly
    samples: int = 0  # samples in all

    def rate(self, prior: float, prior_samples: float) -> float:
        """The share right, shrunk toward `prior` as if it had been seen `prior_samples` times."""
        return (self.right + prior * prior_samples) / (self.samples + prior_samples)


def tallies(outcomes: Iterable[tuple[str, bool]]) -> dict[str, Tally]:
    """Right answers and samples per key, from (key, correct) pairs."""
    right, samples = Counter(), Counter()
    for key, correct in outcomes:
        right[key] += bool(correct)
        samples[key] += 1
    return {key: Tally(right[key], samples[key]) for key in samples}


def disagreement(pass_rate: float, group_size: int) -> float:
    """The chance that `group_size` samples at `pass_rate` are neither all right nor all wrong."""
    return 1.0 - pass_rate**group_size - (1.0 - pass_rate) ** group_size


def estimate(example: MathExample, questions: dict[str, Tally], families: dict[str, Tally]) -> tuple[float, str]:
    """A question's pass rate and where it came from."""
    family = families.get(example.data_source, Tally())
    family_rate = family.rate(0.5, 2)  # Laplace: 1/2 for a family never seen
    where = f"family {family.right}/{family.samples} right" if family.samples else "family unseen: 1/2"
    own = questions.get(example.id)
    if own is None:
        return family_rate, where
    return own.rate(family_rate, FAMILY_PRIOR_SAMPLES), f"question {own.right}/{own.samples} right, {where}"


def frontier_draw(
    pool: Sequence[MathExample],
    history: Iterable[dict],
    count: int,
    group_size: int,
    floor: float,
    seed: Sequence[int],
) -> list[Draw]:
    """`count` questions of `pool` by the outcomes in `history` (rows with example_id, data_source and correct:
    trajectories.parquet of earlier steps); `seed` seeds the draw (the run's seed and the step)."""
    history = list(history)
    questions = tallies((row["example_id"], row["correct"]) for row in history)
    families = tallies((row["data_source"], row["correct"]) for row in history)
    estimates = [estimate(example, questions, families) for example in pool]
    weights = np.array([max(disagreement(rate, group_size), floor) for rate, _ in estimates])
    generator = np.random.Generator(np.random.PCG64(list(seed)))
    chosen = []
    while len(chosen) < count:  # a pool smaller than a step: each question once before any twice, as the walk does
        size = min(count - len(chosen), len(pool))
        chosen += generator.choice(len(pool), size=size, replace=False, p=weights / weights.sum()).tolist()
    return [Draw(pool[i], estimates[i][0], float(weights[i]), estimates[i][1]) for i in chosen]
