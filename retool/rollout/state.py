"""The multi-turn rollout state machine.

A round is three steps over the trajectories (each updates them in place), which the pipeline runs as
separate stages and `rollout_in_memory` (in_memory.py) in one loop; `end_step` (scoring.py) then scores the
step:

    plan_requests   live trajectories            -> sample requests (ends those without budget)
    apply_samples   trajectories + sampled turns -> pending executions (ends answers, invalid turns)
    apply_results   pending + sandbox results    -> observations appended, or the trajectory ends

Names follow the reference chapter (rollout-state-machine): make_request, begin_advance,
fit_tool_content, finish_advance (and, in scoring.py, score_trajectory, assign_group_advantages).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from retool.config.rollout import RolloutConfig, sample_seed
from retool.data.examples import MathExample
from retool.data.reward import last_boxed
from retool.protocol.chat import ChatProtocol
from retool.protocol.tool_calls import neutralise, parse_assistant
from retool.sampling.contract import SampledSequence, SampleRequest, SamplingSettings
from retool.sandbox.call import Sandbox
from retool.sandbox.observation import ExecutionResult

STOP_REASONS = (
    "answer",
    "invalid",
    "max_code_calls",
    "max_turns",
    "token_budget",
    "turn_budget",
    "observation_over_budget",
    "prompt_over_budget",
)
TRUNCATION_MARKER = "[... truncated ...]\n"
REFUSED = "refused"  # ToolCall.status of a call asked for with no calls left ([rollout] calls_spent = answer_turn)
NO_CALLS_LEFT = "No code calls are left: do not call the tool again. Give the final answer now, as \\boxed{answer}."


@dataclass(frozen=True)
class ToolCall:
    call_id: str  # code-{question}-{branch}-{n}
    code: str  # what the sandbox ran
    status: str  # ok | error | timeout; refused: not run, no calls left (answered by NO_CALLS_LEFT)
    seconds: float  # sandbox wall time
    content: str  # the observation as appended (after neutralising and truncation); "" if it did not fit


@dataclass
class AssistantTurn:
    # Lists as sampled; numpy views of the round's file where replayed with tokens; None where replayed without
    prompt_tokens: Sequence[int] | None  # P(i): the full model input of this turn
    completion_tokens: Sequence[int] | None  # C(i): the sampler's tokens
    logprobs: Sequence[float] | None  # L(i): the sampler's logprob of each token of C(i)
    text: str  # decoded from C(i), stripped; what the protocol parses
    finish_reason: str  # stop | length
    seed: int  # the sampling seed of this turn
    kind: str = ""  # tool | answer | invalid, filled right after the turn is recorded
    tool_call: ToolCall | None = None  # the executed call, when there was one
    prompt_length: int | None = None  # len(P(i)), also where only the lengths were replayed (None: not replayed)
    completion_length: int | None = None  # len(C(i)), likewise

    def __post_init__(self) -> None:
        if self.prompt_tokens is not None:
            self.prompt_length, self.completion_length = len(self.prompt_tokens), len(self.completion_tokens)


@dataclass
class Trajectory:
    example: MathExample  # the question and its reference answer
    question_index: int  # position of the question in this step's batch
    group_index: int  # branch within the question's group
    messages: list[dict]  # readable history: system, user, assistant, tool
    next_prompt_tokens: list[int] | None = None  # the exact next prompt; None once done
    turns: list[AssistantTurn] = field(default_factory=list)  # every sampled action, in order
    code_calls: int = 0  # observations appended to the history
    done: bool = False
    stop_reason: str | None = None  # one of STOP_REASONS once done
    final_text: str = ""  # the text the reward reads
    reward: float | None = None  # +1 / -1, set after every trajectory has ended
    valid_format: bool = False
    correct: bool = False
    extracted_answer: str | None = None
    shaped_reward: float | None = None  # the reward the advantage is computed from: `reward` with [reward]'s terms
    advantage: float | None = None  # shaped reward minus the group's mean shaped reward
    kept: bool = True  # its group trains this step (see keep_groups)
    masked: bool = False  # left out of the loss: stopped by a budget, with [reward] overlong = mask

    def end(self, stop_reason: str, final_text: str) -> None:
        """Ends the trajectory; `final_text` is what the reward reads."""
        assert stop_reason in STOP_REASONS, stop_reason
        self.done, self.stop_reason, self.next_prompt_tokens = True, stop_reason, None
        self.final_text = final_text

    def valid_code_calls(self) -> int:
        """Code calls that ran without an error or a timeout."""
        return sum(turn.tool_call is not None and turn.tool_call.status == "ok" for turn in self.turns)

    def num_tokens(self) -> int:
        """len(token_ids()), from the turns' lengths alone."""
        if not self.turns:
            return len(self.next_prompt_tokens or [])
        return self.turns[-1].prompt_length + self.turns[-1].completion_length

    def sampled_tokens(self) -> int:
        """The tokens the model sampled: every turn's completion."""
        return sum(turn.completion_length for turn in self.turns)

    def token_ids(self) -> list[int]:
        """The whole sequence: the last prompt plus the last completion."""
        if not self.turns:
            return list(self.next_prompt_tokens or [])
        last = self.turns[-1]
        return [*map(int, last.prompt_tokens), *map(int, last.completion_tokens)]  # lists or numpy views


@dataclass(frozen=True)
class PendingExecution:
    trajectory: Trajectory  # where the result is written back
    code: str  # what the sandbox runs
    call_id: str
    messages_before_assistant: list[dict]  # history before this turn: the context of the delta
    assistant_text: str  # scored as the final text if the observation cannot be appended
    prompt_tokens: list[int]  # P(i)
    completion_tokens: list[int]  # C(i)
    refused: bool = False  # asked for with no calls left: not run, answered by NO_CALLS_LEFT (see answer_turn_left)


def sampling_settings(config: RolloutConfig, protocol: ChatProtocol) -> SamplingSettings:
    """How every turn samples: the run's temperature and top_p, stopping at the protocol's end of turn."""
    return SamplingSettings(config.temperature, config.top_p, protocol.stop_token_ids, protocol.stop_strings)


def start_trajectories(
    examples: Sequence[MathExample],
    protocol: ChatProtocol,
    config: RolloutConfig,
    question_indices: Sequence[int] | None = None,
) -> list[Trajectory]:
    """`group_size` independent branches per question, all waiting on the question's first prompt.
    Questions are numbered in order unless `question_indices` gives their place in the step."""
    trajectories = []
    for question_index, example in zip(question_indices or range(len(examples)), examples, strict=True):
        messages = protocol.initial_messages(example.question)
        prompt = protocol.build_prompt(messages)
        for group_index in range(config.group_size):
            trajectories.append(
                Trajectory(example, question_index, group_index, [dict(m) for m in messages], list(prompt))
            )
    return trajectories


def can_code(trajectory: Trajectory, config: RolloutConfig, turns_after_this: int) -> bool:
    """The reference's can_code rule: a tool call runs only while the trajectory has calls left and
    the turn is not its last allowed one (so an answer turn can still follow the observation)."""
    return trajectory.code_calls < config.max_code_calls and turns_after_this < config.max_assistant_turns


def answer_turn_left(trajectory: Trajectory, config: RolloutConfig) -> bool:
    """[rollout] calls_spent = answer_turn: a call asked for with every call spent is answered by NO_CALLS_LEFT and
    one more turn, once a trajectory (a call in that turn ends it, as the seed ends every such call)."""
    spent = trajectory.code_calls >= config.max_code_calls
    refused = any(turn.tool_call is not None and turn.tool_call.status == REFUSED for turn in trajectory.turns)
    return config.calls_spent == "answer_turn" and spent and not refused


def turn_budget(trajectory: Trajectory, protocol: ChatProtocol, config: RolloutConfig) -> int:
    """Tokens the next turn may generate: within the turn cap and the trajectory budget, keeping room
    for the tool wrapper and a minimal observation when the turn could still call the tool."""
    remaining = config.max_trajectory_tokens - len(trajectory.next_prompt_tokens)
    if can_code(trajectory, config, turns_after_this=len(trajectory.turns) + 1):
        remaining -= protocol.tool_wrapper_tokens(trajectory.messages) + config.min_tool_response_tokens
    return min(config.max_assistant_tokens, remaining)


def make_request(
    trajectories: Sequence[Trajectory], protocol: ChatProtocol, config: RolloutConfig, step: int
) -> SampleRequest | None:
    """One request for branches that share a prompt (a question's whole group in the first round, a
    single branch later). Ends them instead when no token can be generated within budget."""
    first = trajectories[0]
    max_tokens = turn_budget(first, protocol, config)
    if max_tokens <= 0:
        for trajectory in trajectories:
            # No answer turn fits after the last observation: the trajectory never answered, and its final text is
            # empty (-1), as in the seed; a \boxed{} written before a call the model made anyway earns nothing.
            trajectory.end("prompt_over_budget" if not trajectory.turns else "token_budget", "")
        return None
    return SampleRequest(
        question_index=first.question_index,
        group_indices=tuple(t.group_index for t in trajectories),
        prompt_tokens=tuple(first.next_prompt_tokens),
        max_tokens=max_tokens,
        seed=turn_seed(first, config, step),
    )


def turn_seed(trajectory: Trajectory, config: RolloutConfig, step: int) -> int:
    """The seed of the trajectory's next turn: its question's for the first (the group shares one request), then
    the branch's own."""
    turn = len(trajectory.turns)
    return sample_seed(config.seed, step, trajectory.question_index, 0 if turn == 0 else trajectory.group_index, turn)


def plan_requests(
    trajectories: Sequence[Trajectory], protocol: ChatProtocol, config: RolloutConfig, step: int
) -> list[SampleRequest]:
    """Requests for every live trajectory: branches with no turn yet share their question's first
    prompt and are asked for together (n = group size); every other branch alone (n = 1)."""
    groups: dict[tuple[int, int], list[Trajectory]] = defaultdict(list)
    for trajectory in trajectories:
        if not trajectory.done:
            key = (trajectory.question_index, -1 if not trajectory.turns else trajectory.group_index)
            groups[key].append(trajectory)
    requests = [make_request(group, protocol, config, step) for _, group in sorted(groups.items())]
    return [request for request in requests if request is not None]


def stop_reason_of(kind: str, text: str, sequence: SampledSequence, config: RolloutConfig) -> str:
    """Why a turn without a runnable call ends its trajectory. A turn cut off by the token cap with no
    \\boxed{} answer did not answer: it ran out of its own budget (turn_budget) or the trajectory's
    (token_budget). A cut-off turn holds every token it was allowed (the sampler's contract: "length" is
    max_tokens reached), so its length says which: the turn's cap, or a smaller max_tokens left by the trajectory."""
    if sequence.finish_reason == "length" and last_boxed(text) is None:
        return "turn_budget" if len(sequence.tokens) >= config.max_assistant_tokens else "token_budget"
    return "answer" if kind == "answer" else "invalid"


def turn_text(protocol: ChatProtocol, sequence: SampledSequence) -> str:
    """A sampled turn's text: decoded from its tokens (never trusted separately), stripped."""
    return protocol.decode(list(sequence.tokens)).strip()


def begin_advance(
    trajectory: Trajectory,
    sequence: SampledSequence,
    seed: int,
    protocol: ChatProtocol,
    config: RolloutConfig,
    text: str | None = None,
) -> PendingExecution | None:
    """Records the sampled turn (sampled from the trajectory's next prompt with `seed`) first, then parses it: a
    runnable tool call becomes a pending execution; anything else ends the trajectory. `text`: turn_text's, where a
    samples file already holds it."""
    text = turn_text(protocol, sequence) if text is None else text
    turn = AssistantTurn(
        list(trajectory.next_prompt_tokens),
        list(sequence.tokens),
        list(sequence.logprobs),
        text,
        sequence.finish_reason,
        seed,
    )
    trajectory.turns.append(turn)
    parsed = parse_assistant(text, protocol.tool_format)
    turn.kind = parsed.kind
    messages_before_assistant = list(trajectory.messages)
    trajectory.messages.append(protocol.assistant_message(text))
    if parsed.kind != "tool":
        trajectory.end(stop_reason_of(parsed.kind, text, sequence, config), text)
        return None
    refused = not can_code(trajectory, config, turns_after_this=len(trajectory.turns))
    if refused and not answer_turn_left(trajectory, config):
        trajectory.end("max_code_calls" if trajectory.code_calls >= config.max_code_calls else "max_turns", text)
        return None
    call_id = f"code-{trajectory.question_index}-{trajectory.group_index}-{trajectory.code_calls + 1}"
    return PendingExecution(
        trajectory, parsed.code, call_id, messages_before_assistant, text, turn.prompt_tokens, turn.completion_tokens,
        refused,
    )  # fmt: skip


def apply_samples(
    trajectories: Sequence[Trajectory],
    requests: Sequence[SampleRequest],
    replies: Sequence[Sequence[SampledSequence]],
    protocol: ChatProtocol,
    config: RolloutConfig,
) -> list[PendingExecution]:
    by_branch = {(t.question_index, t.group_index): t for t in trajectories}
    pendings = []
    for request, sequences in zip(requests, replies, strict=True):
        for group_index, sequence in zip(request.group_indices, sequences, strict=True):
            pending = begin_advance(
                by_branch[(request.question_index, group_index)], sequence, request.seed, protocol, config
            )
            if pending is not None:
                pendings.append(pending)
    return pendings


def cut_to_fit(content: str, protocol: ChatProtocol, overflow: Callable[[str], int]) -> str | None:
    """`content`, or its tail after TRUNCATION_MARKER, holding the most tokens for which `overflow(text)`
    (tokens over budget) is at most 0, counted on the real tokens. Each retry keeps strictly fewer tokens,
    so this always ends; None when even the bare truncation marker does not fit."""
    content_ids = protocol.encode(content)
    keep = len(content_ids)
    while True:
        if keep == len(content_ids):
            text = content
        else:
            text = (
                TRUNCATION_MARKER + protocol.decode(content_ids[len(content_ids) - keep :])
                if keep
                else TRUNCATION_MARKER.rstrip("\n")
            )
        over = overflow(text)
        if over <= 0:
            return text
        if keep == 0:
            return None
        keep = max(0, min(keep - over, keep - 1))


def fit_tool_content(
    pending: PendingExecution, content: str, protocol: ChatProtocol, config: RolloutConfig
) -> tuple[str, list[int]] | None:
    """The observation and next prompt, with the content cut to its tail so that it holds at most
    max_tool_response_tokens and the next prompt at most max_trajectory_tokens; None when nothing fits."""
    before = len(pending.prompt_tokens) + len(pending.completion_tokens)
    deltas: dict[str, list[int]] = {}  # D(i) of each text tried: the next prompt is built once, for the one kept

    def overflow(text: str) -> int:
        deltas[text] = protocol.observation_delta(
            pending.messages_before_assistant, pending.completion_tokens, text, pending.call_id
        )
        return max(
            protocol.count_tokens(text) - config.max_tool_response_tokens,
            before + len(deltas[text]) - config.max_trajectory_tokens,
        )

    text = cut_to_fit(content, protocol, overflow)
    if text is None:
        return None
    return text, protocol.build_next_prompt(pending.prompt_tokens, pending.completion_tokens, deltas[text])


def finish_advance(
    pending: PendingExecution, result: ExecutionResult, content: str, protocol: ChatProtocol, config: RolloutConfig
) -> None:
    """Appends the observation and the next prompt, or ends the trajectory when it cannot fit."""
    trajectory = pending.trajectory
    fitted = fit_tool_content(pending, content, protocol, config)
    appended = fitted[0] if fitted else ""
    trajectory.turns[-1].tool_call = ToolCall(pending.call_id, pending.code, result.status, result.seconds, appended)
    if fitted is None:
        trajectory.end("max_code_calls" if pending.refused else "observation_over_budget", pending.assistant_text)
        return
    trajectory.messages.append(protocol.tool_message(appended, pending.call_id))
    trajectory.next_prompt_tokens = fitted[1]
    trajectory.code_calls += 0 if pending.refused else 1  # observations of code that ran


def execute(pendings: Sequence[PendingExecution], sandbox: Sandbox) -> list[ExecutionResult]:
    """The round's calls run concurrently, their results in order; a refused call is not run."""
    ran = iter(sandbox.run_many([pending.code for pending in pendings if not pending.refused]))
    return [ExecutionResult(REFUSED, "", "", 0.0, None) if pending.refused else next(ran) for pending in pendings]


def apply_results(
    pendings: Sequence[PendingExecution],
    results: Sequence[ExecutionResult],
    sandbox: Sandbox,
    protocol: ChatProtocol,
    config: RolloutConfig,
) -> None:
    for pending, result in zip(pendings, results, strict=True):
        observed = NO_CALLS_LEFT if pending.refused else sandbox.observation(result)
        finish_advance(pending, result, neutralise(observed, protocol.forbidden_strings), protocol, config)
