"""A step's or an evaluation's trajectories as one self-contained HTML page (`python -m retool view`): for each, the
turns as the model saw them (question, the model's text and code, the tool's output, the answer, reward and
advantage) and the token view (each token coloured by role, the tokens the loss trains on marked, the sampler's
logprob on hover), with filters by question, family, correctness and stop reason (also set from the link:
`trajectories.html#correct=false&stop=answer`). No server and no network: the
page holds its data and its few lines of script."""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from retool.files import layout
from retool.files.atomic import write_text_atomically
from retool.files.layout import RoundPaths, StepFolder
from retool.files.tables import DATUMS, OBSERVATIONS, PROMPTS, SAMPLES, TRAJECTORIES, read_table

ROLES = ("prompt", "sampled", "observation")  # the question's prompt, the model's tokens, what was appended after


@dataclass(frozen=True)
class Token:
    text: str  # the token decoded on its own
    role: str  # one of ROLES
    loss: bool  # the update trains on it (a sampled token of a trajectory that built a datum)
    logprob: float | None  # the sampler's logprob of a sampled token


@dataclass(frozen=True)
class Turn:
    text: str  # the model's text of the turn
    kind: str  # tool | answer | invalid ("" when not recorded)
    code: str | None  # the code the sandbox ran
    status: str | None  # ok | error | timeout
    output: str | None  # the tool's output as appended


@dataclass(frozen=True)
class TrajectoryView:
    question_index: int
    group_index: int
    question: str
    family: str  # data_source
    outcome: dict  # its row of trajectories.parquet
    turns: list[Turn]
    tokens: list[Token]

    @property
    def key(self) -> str:
        return f"q{self.question_index}-b{self.group_index}"


@dataclass(frozen=True)
class PageFiles:
    """The files a page is drawn from: one step's or one evaluation's."""

    prompts: Path  # prompts.parquet
    rounds: Sequence[RoundPaths]  # every round of every shard
    trajectories: Path  # trajectories.parquet
    datums: Path | None  # datums.parquet of a training step; None: an evaluation, which trains on nothing

    @classmethod
    def of(cls, folder: StepFolder) -> PageFiles:
        """The files of a step's or an evaluation's folder as found on disk."""
        rounds = [RoundPaths(r / layout.SAMPLES_FILE, r / layout.OBSERVATIONS_FILE) for r in folder.round_folders()]
        datums = folder.datums if folder.datums.is_file() else None
        return cls(folder.prompts, rounds, folder.trajectories, datums)


def write_page(files: PageFiles, title: str, decode: Callable[[int], str], out: Path) -> int:
    """Writes the page of the trajectories of a step or an evaluation; returns how many it shows."""
    samples = pa.concat_tables([read_table(r.samples, SAMPLES) for r in files.rounds])
    observations = pa.concat_tables([read_table(r.observations, OBSERVATIONS) for r in files.rounds])
    datums = read_table(files.datums, DATUMS).to_pylist() if files.datums else []
    trained = {(row["question_index"], row["group_index"]) for row in datums}
    prompts, trajectories = read_table(files.prompts, PROMPTS), read_table(files.trajectories, TRAJECTORIES)
    views = trajectory_views(prompts, samples, observations, trajectories, trained, decode)
    write_text_atomically(out, render_page(title, views))
    return len(views)


def trajectory_views(
    prompts: pa.Table,
    samples: pa.Table,
    observations: pa.Table,
    trajectories: pa.Table,
    trained: set[tuple[int, int]],
    decode: Callable[[int], str],
) -> list[TrajectoryView]:
    """The views of a step's (or an evaluation's) trajectories from its files; `trained`: the (question, branch)
    pairs that built a datum, whose sampled tokens carry the loss."""
    questions = {row["question_index"]: row for row in prompts.to_pylist()}
    turns: dict[tuple[int, int], list[dict]] = {}
    for row in sorted(samples.to_pylist(), key=lambda row: row["round"]):
        turns.setdefault((row["question_index"], row["group_index"]), []).append(row)
    executed = {(row["question_index"], row["group_index"], row["round"]): row for row in observations.to_pylist()}
    views = []
    for outcome in trajectories.to_pylist():
        key = (outcome["question_index"], outcome["group_index"])
        sampled = turns.get(key, [])
        steps = [_turn(row, executed.get((*key, row["round"]))) for row in sampled]
        prompt = questions[key[0]]
        tokens = token_view(prompt["prompt_tokens"], sampled, key in trained, decode)
        views.append(TrajectoryView(*key, prompt["question"], prompt["data_source"], outcome, steps, tokens))
    return views


def _turn(sample: dict, observation: dict | None) -> Turn:
    observation = observation or {}
    return Turn(
        sample["text"],
        observation.get("kind") or "",
        observation.get("code"),
        observation.get("exec_status"),
        observation.get("tool_content"),
    )


def token_view(first_prompt: Sequence[int], turns: Sequence[dict], trained: bool, decode) -> list[Token]:
    """The trajectory's whole token sequence (the last turn's prompt and completion), each token with its role:
    the first prompt's tokens, the model's (its turns' completions), and what each later prompt appended."""
    tokens = [Token(decode(t), "prompt", False, None) for t in first_prompt]
    for turn in turns:
        appended = turn["prompt_tokens"][len(tokens) :]
        tokens += [Token(decode(t), "observation", False, None) for t in appended]
        tokens += [
            Token(decode(t), "sampled", trained, logprob)
            for t, logprob in zip(turn["completion_tokens"], turn["logprobs"], strict=True)
        ]
    return tokens


STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
#filters { position: sticky; top: 0; background: #fff; padding: .5em 0; border-bottom: 1px solid #ccc; }
#filters label { margin-right: 1em; }
.trajectory { border: 1px solid #ccc; border-radius: 6px; margin: 1em 0; padding: .5em 1em; }
.trajectory.correct { border-left: 6px solid #2a2; } .trajectory.wrong { border-left: 6px solid #c33; }
.outcome span { margin-right: 1.2em; } .question { font-weight: 600; margin: .4em 0; }
pre { white-space: pre-wrap; background: #f6f6f6; padding: .4em; margin: .3em 0; }
pre.tool-output { background: #eef6ee; } pre.tool-output.error, pre.tool-output.timeout { background: #fbeaea; }
.tokens { font: 12px/1.8 ui-monospace, monospace; white-space: pre-wrap; word-break: break-all; }
.tok.prompt { background: #e8e8e8; } .tok.sampled { background: #dbe9ff; } .tok.observation { background: #e3f5e1; }
.tok.loss { box-shadow: inset 0 -2px #1f5fd6; }
.legend .tok { padding: 0 .3em; margin-right: .5em; }
"""

SCRIPT = """
const fields = ["question", "family", "correct", "stop"];
function applyFilters() {
  const wanted = Object.fromEntries(fields.map(f => [f, document.getElementById("f-" + f).value]));
  let shown = 0;
  for (const node of document.querySelectorAll(".trajectory")) {
    const visible = fields.every(f => wanted[f] === "" || node.dataset[f] === wanted[f]);
    node.hidden = !visible;
    shown += visible;
  }
  document.getElementById("shown").textContent = shown;
}
const initial = new URLSearchParams(location.hash.slice(1));  // a link may set filters: page.html#correct=false
for (const f of fields) {
  const select = document.getElementById("f-" + f);
  if (initial.has(f)) select.value = initial.get(f);
  select.addEventListener("change", applyFilters);
}
applyFilters();
"""


def render_page(title: str, views: Sequence[TrajectoryView]) -> str:
    """The whole page: filters, a legend, and one block per trajectory."""
    options = {
        "question": sorted({str(v.question_index) for v in views}, key=int),
        "family": sorted({v.family for v in views}),
        "correct": ["true", "false"],
        "stop": sorted({str(v.outcome["stop_reason"]) for v in views}),
    }
    filters = "".join(
        f'<label>{name} <select id="f-{name}"><option value="">all</option>'
        + "".join(f'<option value="{html.escape(value)}">{html.escape(value)}</option>' for value in values)
        + "</select></label>"
        for name, values in options.items()
    )
    legend = (
        '<p class="legend"><span class="tok prompt">prompt</span><span class="tok sampled">sampled by the model'
        '</span><span class="tok observation">appended (tool output, turn markers)</span><span class="tok sampled '
        "loss\">trained on (loss)</span> hover a sampled token for the sampler's logprob</p>"
    )
    blocks = "".join(_block(view) for view in views)
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
        f'<div id="filters">{filters} <span><span id="shown">{len(views)}</span> of {len(views)} shown</span></div>'
        f"{legend}{blocks}<script>{SCRIPT}</script></body></html>"
    )


def _block(view: TrajectoryView) -> str:
    outcome = view.outcome
    correct = bool(outcome["correct"])
    facts = {
        "question": view.question_index,
        "branch": view.group_index,
        "family": view.family,
        "correct": correct,
        "reward": outcome["reward"],
        "shaped reward": outcome.get("shaped_reward"),
        "advantage": outcome["advantage"],
        "stop": outcome["stop_reason"],
        "answer": f"{outcome['extracted_answer']} (reference {outcome['answer']})",
    }
    shown = "".join(f"<span>{name}: <b>{html.escape(_shown(value))}</b></span>" for name, value in facts.items())
    data = {"question": view.question_index, "family": view.family, "correct": str(correct).lower()}
    attributes = " ".join(f'data-{name}="{html.escape(str(value))}"' for name, value in data.items())
    attributes += f' data-stop="{html.escape(str(outcome["stop_reason"]))}"'
    return (
        f'<section class="trajectory {"correct" if correct else "wrong"}" id="{view.key}" {attributes}>'
        f'<div class="outcome">{shown}</div><div class="question">{html.escape(view.question)}</div>'
        + "".join(_turn_html(number, turn) for number, turn in enumerate(view.turns, start=1))
        + f"<details><summary>tokens ({len(view.tokens)}, {sum(t.loss for t in view.tokens)} trained on)</summary>"
        f'<div class="tokens">{"".join(_token_html(token) for token in view.tokens)}</div></details></section>'
    )


def _turn_html(number: int, turn: Turn) -> str:
    parts = [f'<div class="turn"><div>turn {number}: {html.escape(turn.kind or "sampled")}</div>']
    parts.append(f'<pre class="model-text">{html.escape(turn.text)}</pre>')
    if turn.output is not None and turn.code is not None:
        status = html.escape(turn.status or "")
        parts.append(f'<pre class="tool-output {status}" title="the tool, {status}">{html.escape(turn.output)}</pre>')
    return "".join(parts) + "</div>"


def _token_html(token: Token) -> str:
    classes = f"tok {token.role}" + (" loss" if token.loss else "")
    title = f' title="logprob {token.logprob:.3f}"' if token.logprob is not None else ""
    return f'<span class="{classes}"{title}>{html.escape(token.text)}</span>'


def _shown(value) -> str:
    if isinstance(value, float):
        return f"{value:+.3f}"
    return "—" if value is None else str(value)
