"""`python -m retool settings [SECTION ...]`: every setting by section, with its default and the comment it is
declared with, and how to set it (luigi.cfg, LUIGI_CONFIG_PATH, or --section-name on the command line)."""

from __future__ import annotations

import argparse
import inspect
import re
from dataclasses import MISSING, fields

from retool.config.settings import RunSettings, setting_fields

FIELD = re.compile(r"^\s{4}(\w+): [^=]+=\s*(.*?)\s*(?:#\s*(.*))?$")  # name: type = default  # comment


def declared_comments(config: type) -> dict[str, str]:
    """Each field's comment as its dataclass declares it: the comment lines above the field and the one after it.
    The declarations are the one place a setting is described, so this reads them rather than repeating them."""
    comments, above = {}, []
    for line in inspect.getsource(config).splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("# ").rstrip())
            continue
        match = FIELD.match(line)
        if match:
            comments[match.group(1)] = " ".join([*above, match.group(3) or ""]).strip()
        above = []
    return comments


def describe(section: str) -> list[str]:
    """The lines of one section: each setting with its default and comment."""
    config = next(f.default_factory for f in fields(RunSettings) if f.name == section)
    comments = declared_comments(config)
    lines = [f"[{section}]"]
    for setting in setting_fields(section, config):
        default = "" if setting.default is MISSING else setting.default
        shown = str(default).lower() if isinstance(default, bool) else default
        lines.append(f"  {setting.name} = {shown}")
        lines.append(
            f"      --{section}-{setting.name}".replace("_", "-") + f"  {comments.get(setting.name, '')}".rstrip()
        )
    return lines


def main() -> int:
    sections = [f.name for f in fields(RunSettings)]
    parser = argparse.ArgumentParser(prog="python -m retool settings", description=__doc__)
    parser.add_argument("sections", nargs="*", metavar="SECTION", help=", ".join(sections))
    args = parser.parse_args()
    for unknown in sorted(set(args.sections) - set(sections)):
        parser.error(f"no section [{unknown}]; the sections are {', '.join(sections)}")
    for section in args.sections or sections:
        print("\n".join(describe(section)), end="\n\n")
    print("Set them in luigi.cfg, in a file named by LUIGI_CONFIG_PATH, or on the command line (docs/settings.md).")
    return 0
