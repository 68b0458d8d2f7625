"""Test doubles: tool-call text in either format, scripted policies, and an instant sandbox."""

from __future__ import annotations

import http.server
import json
import threading
from dataclasses import dataclass
from pathlib import Path

from retool.config.rollout import seed_field
from retool.config.sandbox import SandboxConfig
from retool.protocol.chat import ChatProtocol
from retool.protocol.tool_calls import tool_call_text as protocol_tool_call_text
from retool.sandbox.observation import ExecutionResult, observation_text

REPO = Path(__file__).resolve().parent.parent  # the repository's root


def tool_call_text(code: str, tool_format: str, preamble: str = "Let me compute this.") -> str:
    return protocol_tool_call_text(code, tool_format, preamble)


def completion(
    protocol: ChatProtocol, text: str, close: bool = True, logprob: float = -0.25
) -> tuple[list[int], list[float]]:
    """Tokens of `text` (plus the end-of-turn token when `close`), with a constant logprob."""
    tokens = protocol.encode(text) + ([protocol.stop_token_ids[0]] if close else [])
    return tokens, [logprob] * len(tokens)


@dataclass
class InstantSandbox:
    """Runs nothing: code `print('x' * N)` 'prints' N x's, anything else prints the code back."""

    calls: int = 0  # codes run so far

    def run_many(self, codes):
        results = []
        for code in codes:
            if code.startswith("print('x' * ") and code.endswith(")"):
                output = "x" * int(code[len("print('x' * ") : -1]) + "\n"
            else:
                output = f"ran: {code}\n"
            results.append(ExecutionResult("ok", output, "", 0.001, 0))
        self.calls += len(codes)
        return results

    def observation(self, result: ExecutionResult) -> str:
        return observation_text(result, SandboxConfig())  # the sandbox's own rule, as configured by default


def turn_of(request) -> int:
    """The turn number a request samples (packed in its seed, see retool.config.rollout.sample_seed)."""
    return seed_field(request.seed, "turn")


def step_of(request) -> int:
    """The training step a request samples for (its seed's step field holds step + 1)."""
    return seed_field(request.seed, "step") - 1


def scripted(protocol: ChatProtocol, choose, close: bool = True):
    """A script for ScriptedSampler from `choose(question_index, group_index, turn) -> text`, or
    `choose(question_index, group_index, turn, step)` when it takes four arguments, or
    `choose(question_index, group_index, turn, step, prompt)` (the prompt's text) when it takes five."""
    takes = choose.__code__.co_argcount

    def script(request, index):
        where = (request.question_index, request.group_indices[index], turn_of(request))
        where += (step_of(request),) if takes >= 4 else ()
        where += (protocol.tokenizer.decode(request.prompt_tokens),) if takes == 5 else ()
        return completion(protocol, choose(*where), close=close)

    return script


def fake_vllm_server(served: dict) -> http.server.HTTPServer:
    """An HTTP server in a thread of this process that answers every GET as vLLM's /health and /v1/models do for
    `served["model"]` (change it to serve another), and nothing else: it has no completions to give."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": served["model"], "parent": None}]}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def fake_completions_server(
    model: str, reply, requests: list, port: int = 0, posted: list | None = None
) -> http.server.ThreadingHTTPServer:
    """An HTTP server in threads of this process that answers as vLLM's server does for `model`: /health and
    /v1/models, the calls a client makes around sampling (adapters, prefix cache, sleep), and /v1/completions with
    `reply(body, index)` -> the tokens of choice `index` (logprob -0.25 each). Each completion request's body is
    appended to `requests`, and each POST's path and body to `posted`; `port`: 0 = any free one."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def answer(self, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self.answer({"data": [{"id": model, "parent": None}]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
            if posted is not None:
                posted.append((self.path, body))
            if self.path != "/v1/completions":
                return self.answer({})
            requests.append(body)
            choices = []
            for index in range(body["n"]):
                tokens = reply(body, index)[: body["max_tokens"]]
                logprobs = {"token_logprobs": [-0.25] * len(tokens)}
                choices.append({"index": index, "token_ids": tokens, "logprobs": logprobs, "finish_reason": "stop"})
            self.answer({"choices": choices})

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads, server.block_on_close = True, False
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def fault_proxy(target: str, fault_of, hang_seconds: float = 0.0) -> http.server.ThreadingHTTPServer:
    """An HTTP proxy in threads of this process in front of the server at `target` that injects faults into its
    completion calls: `fault_of(n)` for the n-th (from 0) says what happens to it: None (passed on), "500" or "400"
    (answered so, with a message, by the proxy), "reset" (the connection reset, no answer) or "hang" (no answer for
    `hang_seconds`, then the connection closed). Every other call is passed on."""
    import socket
    import struct
    import time

    import requests

    counter = iter(range(10**9))

    class Handler(http.server.BaseHTTPRequestHandler):
        def forward(self, method: str) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0)) if method == "POST" else None
            if self.path == "/v1/completions":
                fault = fault_of(next(counter))
                if fault in ("500", "400"):
                    return self.reply(int(fault), f"injected failure {fault}".encode(), "text/plain")
                if fault == "reset":  # SO_LINGER 0: close() sends a reset
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    return self.connection.close()
                if fault == "hang":
                    time.sleep(hang_seconds)
                    self.close_connection = True
                    return None
            answer = requests.request(method, f"{target}{self.path}", data=body, headers=dict(self.headers))
            self.reply(answer.status_code, answer.content, answer.headers.get("content-type", "application/json"))

        def reply(self, status: int, content: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(content)))
            self.end_headers()
            self.wfile.write(content)

        def do_GET(self):
            self.forward("GET")

        def do_POST(self):
            self.forward("POST")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads, server.block_on_close = True, False
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def start_serve(config: Path, runs: Path, run_name: str = "served"):
    """`python -m retool serve` for `run_name` under `config`, once it has recorded its servers: (the process, the
    run's record in `runs`)."""
    import subprocess
    import sys
    import time

    from retool.files.layout import RunFolder

    command = [sys.executable, "-m", "retool", "serve", "--config", str(config), "--run-name", run_name]
    serve = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    record = RunFolder(runs / run_name).server_record
    deadline = time.monotonic() + 600
    while not record.exists() and serve.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert record.exists(), serve.communicate(timeout=60)[0]
    return serve, record


def assert_verifies(run_dir: Path) -> None:
    """Every rule of `python -m retool verify` holds on a run folder a test made."""
    from retool.verify.run import verify_run

    report = verify_run(run_dir)
    assert report.holds, "\n".join(report.lines())
