"""The trainer out of memory: a micro-batch whose pass raises torch.OutOfMemoryError (what CUDA raises) is retried
once, from the same state, in smaller micro-batches, to the update an uninterrupted step makes; a second time
fails the step, naming the micro-batch and the memory plan."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from retool.training.memory_plan import TrainerOutOfMemoryError
from retool.training.step import load_policy, update_policy
from tests.test_trainer import CONFIG, datum_logprobs, make_datum


class OutOfMemoryAbove:
    """A forward pre-hook on the embedding: a micro-batch of more than `limit` padded tokens raises
    torch.OutOfMemoryError, from the `armed_at`-th pass on (counting gradient passes only, `gradient_only`)."""

    def __init__(self, limit: int, armed_at: int = 1, gradient_only: bool = False) -> None:
        self.limit, self.armed_at, self.gradient_only = limit, armed_at, gradient_only
        self.passes, self.raised = 0, 0

    def __call__(self, module, args):
        if self.gradient_only and not torch.is_grad_enabled():
            return
        self.passes += 1
        if self.passes >= self.armed_at and args[0].numel() > self.limit:
            self.raised += 1
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected: {args[0].numel()} padded tokens)")


def four_datums(model):
    """Completions of prompts of four lengths (39, 33, 27 and 21 tokens in all), old logprobs the model's own."""
    datums = []
    for index, (prompt, advantage) in enumerate([(30, 1.0), (24, -1.0), (18, 1.0), (12, -1.0)]):
        completion = list(range(300 + 20 * index, 310 + 20 * index))
        draft = make_datum(index // 2, index % 2, list(range(200, 200 + prompt)), completion, advantage, [0.0] * 10)
        logprobs = datum_logprobs(model, draft).tolist()
        datums.append(replace(draft, old_logprobs=[lp if m else 0.0 for lp, m in zip(logprobs, draft.loss_mask)]))
    return datums


def trained(model_dir, config, fault: OutOfMemoryAbove | None = None):
    """A step on a fresh tiny LoRA policy (the same initial weights each time): its metrics, trained weights, and
    the weights and optimizer it started from."""
    model, optimizer = load_policy(model_dir, None, config)
    datums = four_datums(model)
    start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    if fault is not None:
        model.get_base_model().model.embed_tokens.register_forward_pre_hook(fault)
    try:
        metrics = update_policy(model, optimizer, datums, config, num_trajectories=4)
    except TrainerOutOfMemoryError as error:
        return error, model, optimizer, start
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return metrics, weights, optimizer, start


@pytest.mark.parametrize(
    "settings, make_fault, bounds_after",
    [
        # The single update's gradient pass (one micro-batch of 4 x 39): re-planned to 2 datums, 78 tokens.
        ({}, lambda: OutOfMemoryAbove(100), "2 datums / 78 padded tokens"),
        # The no-grad pass before two mini-batches.
        ({"ppo_mini_batches": 2}, lambda: OutOfMemoryAbove(100), "2 datums / 78 padded tokens"),
        # The second mini-batch's gradient pass (2 x 33), after the first was applied, under decoupled PPO: its
        # proximal logprobs, taken in a micro-batch of two, serve two micro-batches of one.
        (
            {"ppo_mini_batches": 2, "correction": "tis"},
            lambda: OutOfMemoryAbove(40, armed_at=2, gradient_only=True),
            "1 datum / 33 padded tokens",
        ),
    ],
    ids=["single-update", "pass-before-mini-batches", "second-mini-batch"],
)
def test_a_micro_batch_out_of_memory_is_retried_smaller_to_the_same_update(
    tiny_model_dir, settings, make_fault, bounds_after, caplog
):
    config, fault = replace(CONFIG, **settings), make_fault()
    expected, expected_weights, _, start = trained(tiny_model_dir, config)
    with caplog.at_level(logging.WARNING, logger="retool.training.step"):
        metrics, weights, *_ = trained(tiny_model_dir, config, fault)
    assert fault.raised == 1 and metrics.oom_retries == 1 and expected.oom_retries == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "out of memory in a micro-batch of" in warnings[0]
    assert f"from at most 8 datums / 16384 padded tokens to {bounds_after}" in warnings[0]
    difference = max(float((weights[n] - expected_weights[n]).abs().max()) for n in weights)
    moved = max(float((expected_weights[n] - start[n]).abs().max()) for n in weights)
    print(f"max |weight difference| against the uninterrupted step: {difference:.3e} (the step moved {moved:.1e})")
    assert moved > 1e-3  # lr 5e-3: the tolerance below is far under one update
    # Smaller micro-batches sum the same gradient in another order, and Adam's normalised step magnifies that rounding
    # where a gradient is near zero (1.8e-5 on one of 16384 weights on an AMD EPYC); a datum dropped or counted twice
    # moves half the weights by more than 1e-4 (8.6e-3 and 2.0e-2 at most).
    for name in weights:
        torch.testing.assert_close(weights[name], expected_weights[name], rtol=1e-5, atol=1e-4)
    # The loss nearly cancels over advantages of both signs (3.5e-3 here): its rounding is judged absolutely.
    assert metrics.updates == expected.updates and metrics.loss == pytest.approx(expected.loss, rel=1e-5, abs=1e-6)
    assert metrics.kl_k3 == pytest.approx(expected.kl_k3, rel=1e-3, abs=1e-8)  # the passes line up token by token
    assert metrics.micro_batches > expected.micro_batches  # as the step ended: smaller


def test_a_second_out_of_memory_fails_the_step_naming_the_micro_batch_and_the_plan(tiny_model_dir, caplog):
    fault = OutOfMemoryAbove(0)  # every micro-batch
    with caplog.at_level(logging.WARNING, logger="retool.training.step"):
        error, model, optimizer, start = trained(tiny_model_dir, CONFIG, fault)
    assert isinstance(error, TrainerOutOfMemoryError) and fault.raised == 2
    message = str(error)
    print(message)
    assert "out of memory again in a micro-batch of 2 datums x 39 tokens (78 padded)" in message
    assert "re-planned from at most 8 datums / 16384 padded tokens to 2 datums / 78 padded tokens" in message
    assert "memory plan at 2 datums / 78 padded tokens per micro-batch: " in message
    for figure in ("weights", "trainable_state", "activations", "logits"):
        assert f"{figure} " in message
    assert isinstance(error.__cause__, torch.OutOfMemoryError)
    # The optimizer never stepped, and the failed passes' gradients are gone.
    assert not optimizer.state
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            assert torch.equal(parameter.detach(), start[name]) and parameter.grad is None
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
