import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from retool.config.sandbox import SandboxConfig
from retool.protocol.chat import load_tokenizer
from retool.protocol.tool_calls import neutralise
from retool.rollout.state import TRUNCATION_MARKER
from retool.sandbox.call import Sandbox


def running(marker: str) -> bool:
    """Whether any live process has `marker` in its command line (PIDs inside the sandbox's own
    namespace mean nothing out here, so processes are found by a unique argument)."""
    for stat in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if (
                marker in stat.read_bytes().decode(errors="replace")
                and Path(stat.parent, "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
            ):
                return True
        except OSError:
            continue
    return False


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(
        SandboxConfig(timeout_seconds=3, cpu_seconds=3, memory_mb=512, output_tail_bytes=2000, max_workers=2)
    )


@pytest.fixture(scope="module")
def notebook():
    return Sandbox(
        SandboxConfig(timeout_seconds=3, cpu_seconds=3, memory_mb=512, max_workers=1, observation="notebook")
    )


def test_ok_output(sandbox):
    result = sandbox.run_code("print(6 * 7)")
    assert (result.status, result.stdout, result.exit_code) == ("ok", "42\n", 0)


@pytest.mark.parametrize(
    ("code", "observation"),
    [
        ("x = 3\nx * 2", "6"),
        ("def f():\n    return 1\nif True:\n    y = f()", "(no output)"),  # indented last line
        ("x = 5", "(no output)"),  # an assignment prints nothing
        ("print('a')\nNone", "a"),
        ("'text'", "'text'"),
        ("import math\nfor i in range(2):\n    print(i)\nmath.factorial(5)", "0\n1\n120"),
    ],
)
def test_a_notebook_observation_prints_a_trailing_expression(notebook, code, observation):
    assert notebook.observation(notebook.run_code(code)) == observation


@pytest.mark.parametrize(
    ("code", "observation"),
    [
        ("x = 3\nx * 2", ""),  # nothing printed: an empty string
        ("print(6 * 7)", "42\n"),  # stdout as printed
        ("print('before')\n1 / 0", "ZeroDivisionError"),  # on an error, stderr only
        ("import sys\nsys.exit(3)", "Error: process exited with code 3."),  # an error without stderr
        ("import time\ntime.sleep(10)", "Error: execution timed out after 3 seconds."),
    ],
)
def test_a_seed_observation_is_what_the_code_prints(sandbox, code, observation):
    seen = sandbox.observation(sandbox.run_code(code))
    assert seen == observation or (observation == "ZeroDivisionError" and seen.endswith("division by zero\n"))
    assert "before" not in seen


def test_exception_comes_back_as_traceback(sandbox):
    result = sandbox.run_code("x = 1\n1 / 0")
    assert result.status == "error"
    assert 'File "<code>", line 2' in result.stderr and "ZeroDivisionError: division by zero" in result.stderr
    assert "sandbox_runner" not in result.stderr


def test_syntax_error_comes_back(sandbox):
    result = sandbox.run_code("def f(:\n")
    assert result.status == "error" and "SyntaxError" in result.stderr


def test_timeout_kills_the_whole_process_group(sandbox):
    code = (
        "import subprocess, time\nchild = subprocess.Popen(['sleep', '60.0101'])\n"
        "print(child.pid, flush=True)\ntime.sleep(60)"
    )
    started = time.monotonic()
    result = sandbox.run_code(code)
    assert result.status == "timeout" and "TimeoutError" in result.stderr
    assert time.monotonic() - started < 10
    time.sleep(0.2)
    assert not running("60.0101")


def test_children_left_running_are_killed_after_a_normal_exit(sandbox):
    result = sandbox.run_code("import subprocess\nprint(subprocess.Popen(['sleep', '60.0202']).pid)")
    assert result.status == "ok"
    time.sleep(0.2)
    assert not running("60.0202")


def test_cpu_limit_stops_busy_loops(sandbox):
    result = Sandbox(SandboxConfig(timeout_seconds=20, cpu_seconds=1)).run_code("while True: pass")
    assert result.status == "timeout" and "CPU" in result.stderr


def test_print_flood_is_capped(sandbox):
    result = sandbox.run_code("for i in range(10**6): print('flood', i)")
    assert result.status == "ok"
    assert len(result.stdout) < 2100 and "bytes truncated" in result.stdout
    assert result.stdout.rstrip().endswith("flood 999999")  # the tail is kept


def test_output_file_limit_stops_endless_print():
    small = Sandbox(SandboxConfig(timeout_seconds=20, file_mb=1))
    result = small.run_code("while True: print('x' * 1000)")
    assert result.status == "error" and "OutputLimitError" in result.stderr


def test_memory_bomb_is_stopped(sandbox):
    result = sandbox.run_code("x = bytearray(4 * 1024**3)")
    assert result.status == "error" and "MemoryError" in result.stderr


def test_environment_is_clean(sandbox, monkeypatch):
    monkeypatch.setenv("RETOOL_SECRET", "hunter2")
    result = sandbox.run_code("import os\nprint(sorted(os.environ))\nprint(os.getcwd())")
    assert "RETOOL_SECRET" not in result.stdout and "hunter2" not in result.stdout
    assert "retool-sandbox-" in result.stdout
    assert "OMP_NUM_THREADS" in result.stdout


@pytest.mark.parametrize("prewarmed", [True, False], ids=["pre-warmed", "cold"])
def test_no_file_descriptor_is_inherited(prewarmed):
    sandbox = Sandbox(SandboxConfig(prewarmed=prewarmed, max_workers=1))
    try:
        result = sandbox.run_code(
            "import os\nprint(sorted(os.readlink(f'/proc/self/fd/{fd}') for fd in os.listdir('/proc/self/fd')[:-1]))"
        )
    finally:
        sandbox.close()
    workdir = result.stdout.split(".stdout")[0].rsplit("'", 1)[-1]
    assert result.stdout.strip() == str(["/dev/null", f"{workdir}.stderr", f"{workdir}.stdout"])


def test_working_directory_is_removed(sandbox):
    result = sandbox.run_code("import os\nopen('f.txt', 'w').write('x')\nprint(os.getcwd())")
    assert not Path(result.stdout.strip()).exists()


def test_math_libraries_are_available(sandbox):
    assert sandbox.run_code("import sympy, numpy\nprint(sympy.factorint(360))").stdout.strip() == "{2: 3, 3: 2, 5: 1}"


def test_special_tokens_are_neutralised(sandbox, tokenizer):
    from retool.protocol.chat import special_token_strings

    forbidden = special_token_strings(tokenizer) + ("</tool_response>",)
    text = neutralise(sandbox.observation(sandbox.run_code("print('<|im_end|> and </tool_response>')")), forbidden)
    assert "<|im_end|>" not in text and "</tool_response>" not in text
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") not in ids
    assert text.replace("\u200b", "") == "<|im_end|> and </tool_response>\n"


def test_concurrency_is_bounded_from_threads():
    sandbox = Sandbox(SandboxConfig(max_workers=2))
    code = "import time\ntime.sleep(0.5)\nprint(1)"
    started = time.monotonic()
    results = sandbox.run_many([code] * 4)
    assert [r.stdout for r in results] == ["1\n"] * 4
    assert time.monotonic() - started >= 1.0  # two waves of two


def test_each_status_is_reported(sandbox):
    fresh = Sandbox(SandboxConfig(timeout_seconds=1))
    results = fresh.run_many(["print(1)", "1/0", "import time\ntime.sleep(5)"])
    assert [r.status for r in results] == ["ok", "error", "timeout"] and results[2].seconds >= 1


def test_command_line_prints_the_observation(tmp_path):
    script = tmp_path / "cell.py"
    script.write_text("x = 2 ** 10\nprint(x)")
    shown = subprocess.run(
        [sys.executable, "-m", "retool", "sandbox", str(script)], capture_output=True, text=True, check=True
    )
    assert shown.stdout == "1024\n"
    as_json = subprocess.run(
        [sys.executable, "-m", "retool", "sandbox", str(script), "--json"], capture_output=True, text=True, check=True
    )
    assert json.loads(as_json.stdout)["status"] == "ok"
    script.write_text("1 / 0")  # an error: exit 1, as --help says
    failed = subprocess.run([sys.executable, "-m", "retool", "sandbox", str(script)], capture_output=True, text=True)
    assert failed.returncode == 1 and "ZeroDivisionError" in failed.stdout


def test_command_line_cuts_the_message_to_the_tokens_the_model_would_see(tmp_path, tiny_model_dir):
    script = tmp_path / "loud.py"
    script.write_text("for i in range(2000):\n    print(i)")
    command = [sys.executable, "-m", "retool", "sandbox", str(script), "--tokenizer", str(tiny_model_dir)]
    shown = subprocess.run([*command, "--max-tokens", "40"], capture_output=True, text=True, check=True).stdout
    tokenizer = load_tokenizer(tiny_model_dir)
    assert shown.startswith(TRUNCATION_MARKER) and shown.endswith("1998\n1999\n")
    assert len(tokenizer(shown, add_special_tokens=False)["input_ids"]) <= 40
    whole = subprocess.run(command[:5], capture_output=True, text=True, check=True).stdout
    # No tokenizer: the sandbox's whole message, the output's last 4096 characters.
    assert whole.startswith("[... truncated ") and "\n1500\n" in whole and whole.endswith("1999\n")


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="max_workers"):
        SandboxConfig(max_workers=0)
    with pytest.raises(ValueError, match="timeout_seconds"):
        SandboxConfig(timeout_seconds=0)


def test_prewarmed_and_cold_calls_agree():
    codes = [
        "print(6 * 7)",
        "x = 1\n1 / 0",
        "import sympy\nsympy.factorint(360)",
        "import os\nprint(sorted(os.environ)[:2])",
        "import sys\nsys.exit(3)",
    ]
    cold, warm = Sandbox(SandboxConfig(prewarmed=False)), Sandbox(SandboxConfig(prewarmed=True))
    try:
        for code in codes:
            a, b = cold.run_code(code), warm.run_code(code)
            assert (a.status, a.stdout, a.stderr, a.exit_code) == (b.status, b.stdout, b.stderr, b.exit_code), code
    finally:
        warm.close()


needs_prewarmed = pytest.mark.skipif(
    not Sandbox().prewarmed, reason="pre-warmed servers need namespaces and a pids cgroup"
)


@needs_prewarmed
def test_forked_processes_fork_their_servers_from_the_same_zygote():
    """Luigi's task processes (--workers K) are forked from the scheduling process: each gets
    servers of its own from the zygote that process started, and leaves the parent's alone."""
    sandbox = Sandbox(SandboxConfig(max_workers=1))
    try:
        sandbox.prewarm()
        assert sandbox.run_code("print(1)").stdout == "1\n"
        parent_server = sandbox._servers.get_nowait()
        sandbox._servers.put(parent_server)
        reader, writer = os.pipe()
        child = os.fork()
        if child == 0:
            try:
                result = sandbox.run_code("import sympy\nprint(sympy.factorint(12))")
                child_server = sandbox._servers.get_nowait()
                fine = (
                    result.stdout == "{2: 2, 3: 1}\n"
                    and child_server.pid != parent_server.pid
                    and sandbox._zygote is None
                )
                os.write(writer, b"ok" if fine else repr((result, child_server.pid, parent_server.pid)).encode())
            finally:
                os._exit(0)
        os.close(writer)
        assert os.read(reader, 4096) == b"ok"
        os.waitpid(child, 0)
        assert sandbox.run_code("print(2)").stdout == "2\n"  # the parent's server still serves it
        assert sandbox._servers.get_nowait() is parent_server
    finally:
        sandbox.close()


@needs_prewarmed
def test_code_cannot_reach_the_zygote():
    sandbox = Sandbox(SandboxConfig(max_workers=1))
    try:
        sandbox.prewarm()
        connect = f"s.connect({sandbox._zygote_address!r})"
        code = f"import socket\ns = socket.socket(socket.AF_UNIX)\n{connect}\nprint('connected')"
        result = sandbox.run_code(code)
    finally:
        sandbox.close()
    assert result.status == "error" and "ConnectionRefusedError" in result.stderr and "connected" not in result.stdout


@needs_prewarmed
def test_a_killed_zygote_is_replaced():
    sandbox = Sandbox(SandboxConfig(max_workers=1))
    try:
        sandbox.prewarm()
        os.kill(sandbox._zygote.pid, 9)
        sandbox._zygote.wait()
        assert sandbox.run_code("print(3)").stdout == "3\n"
    finally:
        sandbox.close()


def test_output_over_the_cap_at_exit_is_named_as_the_cap_not_a_closed_stream():
    sandbox = Sandbox(SandboxConfig(file_mb=1, max_workers=1))
    result = sandbox.run_code("import os\nos.write(1, b'x' * 2**20)\nprint('and one more line')")
    assert "OutputLimitError" in sandbox.observation(result)
    assert "printed more than the sandbox keeps" in result.stderr and "closed its standard" not in result.stderr
