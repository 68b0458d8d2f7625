import pytest
import torch

import retool.sampling.progress
from retool.sampling.contract import SampleRequest, SamplingSettings
from retool.sampling.hf import HFSampler
from retool.weights.checkpoint import Checkpoint


@pytest.fixture(scope="module")
def sampler(tiny_model_dir):
    return HFSampler(tiny_model_dir)


def requests_for(sampler):
    prompt_a = tuple(sampler.tokenizer("<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n")["input_ids"])
    prompt_b = tuple(
        sampler.tokenizer("<|im_start|>user\nA longer prompt, so rows need padding<|im_end|>\n<|im_start|>assistant\n")[
            "input_ids"
        ]
    )
    return [SampleRequest(0, (0, 1, 2), prompt_a, 12, seed=7), SampleRequest(1, (3,), prompt_b, 5, seed=8)]


def test_reply_shape_and_lengths(sampler):
    requests = requests_for(sampler)
    replies = sampler.sample(requests, SamplingSettings())
    assert [len(r) for r in replies] == [3, 1]
    for request, sequences in zip(requests, replies):
        for sequence in sequences:
            assert len(sequence.tokens) == len(sequence.logprobs) <= request.max_tokens
            assert sequence.finish_reason in ("stop", "length")


def test_logprobs_match_a_forward_pass_of_the_sampled_tokens(sampler):
    requests = requests_for(sampler)
    replies = sampler.sample(requests, SamplingSettings())
    for request, sequences in zip(requests, replies):
        for sequence in sequences:
            ids = torch.tensor([list(request.prompt_tokens) + list(sequence.tokens)])
            with torch.no_grad():
                logprobs = sampler.model(ids).logits[0].float().log_softmax(-1)
            start = len(request.prompt_tokens) - 1
            expected = [logprobs[start + i, token].item() for i, token in enumerate(sequence.tokens)]
            assert max(abs(a - b) for a, b in zip(expected, sequence.logprobs)) < 1e-4


def test_same_seed_same_samples_whatever_else_is_in_the_batch(sampler):
    requests = requests_for(sampler)
    together = sampler.sample(requests, SamplingSettings())
    alone = sampler.sample(requests[:1], SamplingSettings())
    assert [s.tokens for s in together[0]] == [s.tokens for s in alone[0]]
    reseeded = sampler.sample([SampleRequest(0, (0, 1, 2), requests[0].prompt_tokens, 12, seed=99)], SamplingSettings())
    assert [s.tokens for s in reseeded[0]] != [s.tokens for s in alone[0]]


def test_stop_tokens_and_strings_end_a_row(sampler):
    request = requests_for(sampler)[0]
    free = sampler.sample([request], SamplingSettings())[0][0]
    stop_token = free.tokens[3]
    stopped = sampler.sample([request], SamplingSettings(stop_token_ids=(stop_token,)))[0][0]
    assert stopped.finish_reason == "stop" and stopped.tokens[-1] == stop_token
    assert stop_token not in stopped.tokens[:-1]
    text = sampler.tokenizer.decode(list(free.tokens))
    stop_string = text[len(text) // 2 : len(text) // 2 + 2]
    by_string = sampler.sample([request], SamplingSettings(stop_strings=(stop_string,)))[0][0]
    assert by_string.finish_reason == "stop" and stop_string in sampler.tokenizer.decode(list(by_string.tokens))
    assert len(by_string.tokens) < len(free.tokens) or free.finish_reason == "stop"


def test_sampling_from_a_lora_checkpoint_matches_the_trained_model(tiny_model_dir, tmp_path):
    from retool.config.trainer import TrainerConfig
    from retool.training.checkpoints import save_checkpoint
    from retool.training.step import load_policy, update_policy
    from tests.test_trainer import on_policy_datums

    config = TrainerConfig(lora_rank=4, lora_alpha=8, learning_rate=1e-2, autocast_bfloat16="false").on("cpu")
    model, optimizer = load_policy(tiny_model_dir, None, config)
    metrics = update_policy(model, optimizer, on_policy_datums(model), config, num_trajectories=2)
    save_checkpoint(tmp_path / "checkpoint", model, optimizer, metrics, config, tiny_model_dir)
    sampler = HFSampler(tiny_model_dir)
    request = requests_for(sampler)[0]
    base = sampler.sample([request], SamplingSettings())[0][0]
    sampler.use_policy(Checkpoint(tmp_path / "checkpoint").policy(tiny_model_dir))
    trained = sampler.sample([request], SamplingSettings())[0][0]
    ids = torch.tensor([list(request.prompt_tokens) + list(trained.tokens)])
    model.eval()
    with torch.no_grad():
        logprobs = model(ids).logits[0].float().log_softmax(-1)
    start = len(request.prompt_tokens) - 1
    expected = [logprobs[start + i, token].item() for i, token in enumerate(trained.tokens)]
    assert max(abs(a - b) for a, b in zip(expected, trained.logprobs)) < 1e-4
    assert trained.logprobs != base.logprobs
    sampler.use_policy(None)
    assert sampler.sample([request], SamplingSettings())[0][0] == base


def test_logprobs_are_those_of_the_tempered_distribution(sampler):
    request = requests_for(sampler)[0]
    sequence = sampler.sample([request], SamplingSettings(temperature=0.7))[0][0]
    ids = torch.tensor([list(request.prompt_tokens) + list(sequence.tokens)])
    with torch.no_grad():
        logits = sampler.model(ids).logits[0].float()
    start = len(request.prompt_tokens) - 1
    positions = range(start, start + len(sequence.tokens))
    tempered = [(logits[p] / 0.7).log_softmax(-1)[t].item() for p, t in zip(positions, sequence.tokens)]
    raw = [logits[p].log_softmax(-1)[t].item() for p, t in zip(positions, sequence.tokens)]
    assert max(abs(a - b) for a, b in zip(tempered, sequence.logprobs)) < 1e-4
    assert max(abs(a - b) for a, b in zip(raw, sequence.logprobs)) > 1e-3


def test_progress_is_written_as_lines_when_stderr_is_not_a_terminal(sampler, capsys, monkeypatch):
    monkeypatch.setattr(retool.sampling.progress, "LOG_EVERY_SECONDS", 0.0)
    replies = sampler.sample(requests_for(sampler), SamplingSettings())
    tokens = sum(len(sequence.tokens) for sequences in replies for sequence in sequences)
    lines = capsys.readouterr().err.splitlines()
    assert "\r" not in "".join(lines)
    assert lines[-1].startswith("sampling: 4/4 sequences") and lines[-1].endswith(f", {tokens} tokens"), lines
