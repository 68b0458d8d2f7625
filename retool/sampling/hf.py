"""A transformers sampler, for machines without vLLM and for cross-checks.

Hand-written decode loop, because `generate()` pads finished rows with a token that can also be a
stop token and cannot say where each row stopped on a stop string; with the n samples of a request
sharing one prompt, a plain KV-cached loop needs no padding and reports every token exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from retool.sampling.contract import SampledSequence, SampleRequest, SamplingSettings
from retool.sampling.progress import sampling_progress, set_tokens
from retool.weights.checkpoint import Policy


class HFSampler:
    def __init__(self, model_path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path = Path(model_path)
        self.device = torch.device(device)
        self.dtype = dtype
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype).to(self.device).eval()
        self.policy: Policy | None = None  # the policy whose weights are loaded; None = the model above

    def use_policy(self, policy: Policy | None, in_memory: Mapping[str, torch.Tensor] | None = None) -> None:
        """Loads the policy's weights, with its LoRA adapter merged into them: merging once makes sampling
        as fast as the base model. Full weights `in_memory` are copied into the model in place, in this
        sampler's dtype (the same bits as from the files the trainer wrote from them), when their names are the
        model's own (not where transformers renames a checkpoint's, as for Qwen3.5: it then reads the files)."""
        if policy == self.policy:
            return
        if in_memory is not None and self.model is not None and self._takes(in_memory):
            with torch.no_grad():
                self.model.load_state_dict(in_memory, strict=False)  # all but the second name of a tied weight
            self.policy = policy
            return
        from transformers import AutoModelForCausalLM

        weights = policy.weights if policy is not None else self.model_path
        model = AutoModelForCausalLM.from_pretrained(str(weights), dtype=self.dtype)
        if policy is not None and policy.adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(policy.adapter)).merge_and_unload()
        self.model, self.policy = model.to(self.device).eval(), policy

    def _takes(self, weights: Mapping[str, torch.Tensor]) -> bool:
        """Whether `weights` are every weight of the model under its own names (a tied one once)."""
        own = set(self.model.state_dict())
        once = {name for name, _ in self.model.named_parameters()} | {name for name, _ in self.model.named_buffers()}
        return set(weights) <= own and own & once <= set(weights)

    def sleep(self) -> None:
        pass  # a sampler for machines without vLLM: it keeps its model where it is

    def wake(self) -> None:
        pass

    def close(self) -> None:
        self.model = None

    def sample(self, requests: Sequence[SampleRequest], settings: SamplingSettings) -> list[list[SampledSequence]]:
        if not requests:
            return []
        return self._sample_batch(requests, settings)

    def _prefill(self, prompts: list[tuple[int, ...]]):
        """The left-padded batch of prompts through the model: its cache, the last logits, the mask and
        each row's last position."""
        width = max(len(prompt) for prompt in prompts)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        output = self.model(input_ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        return output.past_key_values, output.logits[:, -1, :].float(), mask, positions[:, -1]

    def _finish_reason(self, tokens: list[int], settings: SamplingSettings, max_tokens: int, window: int) -> str | None:
        """Why a sequence ends after its last token (a stop token or string, or its length); None: it goes on."""
        if tokens[-1] in settings.stop_token_ids:
            return "stop"
        if settings.stop_strings and any(
            stop in self.tokenizer.decode(tokens[-window:]) for stop in settings.stop_strings
        ):
            return "stop"
        return "length" if len(tokens) >= max_tokens else None

    @torch.inference_mode()
    def _sample_batch(
        self, requests: Sequence[SampleRequest], settings: SamplingSettings
    ) -> list[list[SampledSequence]]:
        """Decodes every sample of every request in one left-padded batch; rows leave the batch as
        they finish. Each request draws from its own generator seeded with its seed."""
        owners = [index for index, request in enumerate(requests) for _ in range(request.num_samples)]
        prompts = [requests[index].prompt_tokens for index in owners]
        cache, logits, mask, positions = self._prefill(prompts)
        generators = [torch.Generator(device=self.device).manual_seed(request.seed) for request in requests]
        tokens: list[list[int]] = [[] for _ in owners]
        logprobs: list[list[float]] = [[] for _ in owners]
        finish: list[str | None] = [None] * len(owners)
        window = max((len(stop) for stop in settings.stop_strings), default=0) + 1
        alive = list(range(len(owners)))  # row of each batch position
        progress = sampling_progress(len(owners))
        while alive:
            next_tokens = torch.empty(len(alive), dtype=torch.long, device=self.device)
            for index, generator in enumerate(generators):  # per-request draws keep each seed's stream its own
                batch_positions = [p for p, row in enumerate(alive) if owners[row] == index]
                if batch_positions:
                    next_tokens[batch_positions] = _draw(logits[batch_positions], settings, generator)
            # Logprobs of the distribution drawn from (logits / temperature), as vLLM reports them and the trainer
            # computes them.
            chosen = _logprobs(logits, settings).gather(1, next_tokens[:, None]).squeeze(1).tolist()
            still_alive = []
            for position, row in enumerate(alive):
                tokens[row].append(int(next_tokens[position]))
                logprobs[row].append(chosen[position])
                finish[row] = self._finish_reason(tokens[row], settings, requests[owners[row]].max_tokens, window)
                if finish[row] is None:
                    still_alive.append(position)
            progress.update(len(alive) - len(still_alive))
            set_tokens(progress, sum(map(len, tokens)))
            if not still_alive:
                break
            if len(still_alive) < len(alive):
                keep = torch.tensor(still_alive, device=self.device)
                cache.batch_select_indices(keep)
                mask, positions, next_tokens = mask[keep], positions[keep], next_tokens[keep]
            alive = [alive[position] for position in still_alive]
            mask = torch.cat([mask, mask.new_ones(len(alive), 1)], dim=1)
            positions = positions + 1
            output = self.model(
                next_tokens[:, None],
                attention_mask=mask,
                position_ids=positions[:, None],
                past_key_values=cache,
                use_cache=True,
            )
            cache, logits = output.past_key_values, output.logits[:, -1, :].float()
        progress.close()
        replies: list[list[SampledSequence]] = [[] for _ in requests]
        for row, owner in enumerate(owners):
            replies[owner].append(SampledSequence(tuple(tokens[row]), tuple(logprobs[row]), finish[row] or "length"))
        return replies


def _logprobs(logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """The log of the distribution _draw draws from: logits / temperature, renormalised over the nucleus (the
    smallest set of tokens whose probability reaches top_p) when top_p < 1, -inf outside it."""
    logprobs = torch.log_softmax(logits / settings.temperature, dim=-1)
    if settings.top_p < 1.0:
        sorted_logprobs, order = logprobs.sort(dim=-1, descending=True)
        sorted_probs = sorted_logprobs.exp()
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs > settings.top_p
        nucleus = torch.full_like(logprobs, -torch.inf).scatter(
            1, order, sorted_logprobs.masked_fill(outside, -torch.inf)
        )
        logprobs = torch.log_softmax(nucleus, dim=-1)
    return logprobs


def _draw(logits: torch.Tensor, settings: SamplingSettings, generator: torch.Generator) -> torch.Tensor:
    probs = torch.softmax(logits / settings.temperature, dim=-1)
    if settings.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs > settings.top_p  # keep the smallest set reaching top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)
