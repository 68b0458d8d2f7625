"""Runs inside the sandbox child: applies limits, then executes the model's code as a notebook cell.

Usage (by jobs.sandbox only): python -I sandbox_runner.py CODE_FILE CPU_SECONDS MEMORY_BYTES FILE_BYTES
It imports nothing from the project, so it works in an isolated interpreter.
"""

import ast
import linecache
import resource
import sys
import traceback


def apply_limits(cpu_seconds: int, memory_bytes: int, file_bytes: int) -> None:
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    if memory_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def with_trailing_print(tree: ast.Module) -> ast.Module:
    """Prints the value of a trailing expression, as a notebook cell does (None prints nothing)."""
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = tree.body[-1]
        value = ast.Name(id="__retool_value__", ctx=ast.Load())
        tree.body[-1:] = [
            ast.Assign(targets=[ast.Name(id="__retool_value__", ctx=ast.Store())], value=last.value),
            ast.If(
                test=ast.Compare(left=value, ops=[ast.IsNot()], comparators=[ast.Constant(None)]),
                body=[ast.Expr(ast.Call(ast.Name("print", ast.Load()), [ast.Call(ast.Name("repr", ast.Load()), [value], [])], []))],
                orelse=[],
            ),
        ]
        for node in tree.body[-2:]:
            ast.copy_location(node, last)
            ast.fix_missing_locations(node)
    return tree


def main() -> int:
    code_file, cpu_seconds, memory_bytes, file_bytes = sys.argv[1], *map(int, sys.argv[2:5])
    apply_limits(cpu_seconds, memory_bytes, file_bytes)
    sys.stdout.reconfigure(errors="backslashreplace")
    sys.stderr.reconfigure(errors="backslashreplace")
    with open(code_file, encoding="utf-8") as handle:
        source = handle.read()
    linecache.cache["<code>"] = (len(source), None, source.splitlines(keepends=True), "<code>")  # source lines in tracebacks
    try:
        tree = with_trailing_print(ast.parse(source, filename="<code>"))
    except SyntaxError as error:
        traceback.print_exception(type(error), error, None)
        return 1
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    del sys.argv[1:]
    try:
        exec(compile(tree, "<code>", "exec"), namespace)
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException as error:  # the traceback is the observation; skip this runner's own frame
        traceback.print_exception(type(error), error, error.__traceback__.tb_next)
        return 1
    return 0

if __name__ == "__main__":
    sys.exit(main())
