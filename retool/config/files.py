"""The settings as the config files give them, for the library's own commands (`python -m retool serve`): the files
Luigi reads, in its order, read with the standard library. The tasks read the same files through Luigi
(pipeline/config.py); both refuse a misspelt section or setting and a value of the wrong kind with the same line.
Written by hand because Luigi's reader comes only with Luigi, which the library does not import."""

from __future__ import annotations

import configparser
import difflib
import os
from dataclasses import MISSING, fields
from pathlib import Path

from retool.config.settings import RunSettings, SettingsError, setting_fields

# Luigi's default config files, layered in this order (luigi.configuration.cfg_parser); LUIGI_CONFIG_PATH comes last.
LUIGI_DEFAULT_FILES = ("/etc/luigi/client.cfg", "/etc/luigi/luigi.cfg", "client.cfg", "luigi.cfg")
# Sections Luigi and its contrib modules read from the config files (luigi's docs, "Configuration"): its Config
# classes, and those read without one.
LUIGI_SECTIONS = (
    "core", "worker", "scheduler", "retcode", "email", "smtp", "sendgrid", "batch_email", "execution_summary",
    "logging", "resources", "task_history", "batch_notifier", "elasticsearch", "hadoop", "hdfs", "hive",
    "kubernetes", "mysql", "postgres", "redshift", "scalding", "spark", "webhdfs", "datadog", "bigquery", "ecs",
)  # fmt: skip
# Each settings section's dataclass (the default factory of its RunSettings field).
SECTIONS = {f.name: f.default_factory for f in fields(RunSettings)}
# What a value of each kind must be, as an error says it.
KINDS = {bool: "true or false", int: "an integer", float: "a number"}


def closest(name: str, known: list[str]) -> str:
    """'; did you mean group_size?' for a misspelling, else the section's names."""
    match = difflib.get_close_matches(name, known, n=1)
    return f"; did you mean {match[0]}?" if match else f"; its settings are {', '.join(sorted(known))}"


def check_sections(present: list[str] | tuple[str, ...], also_known: set[str] = frozenset()) -> None:
    """A misspelt section ([rollouts]) would be ignored, its settings left at their defaults: refused instead.
    `also_known`: the sections of the caller's own (Luigi's registered tasks)."""
    known = set(also_known) | set(LUIGI_SECTIONS) | set(SECTIONS)
    for name in present:
        if name not in known:
            match = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"; did you mean [{match[0]}]?" if match else f"; the settings' sections are {', '.join(SECTIONS)}"
            raise SettingsError(f"unknown section [{name}] in the config files{hint}")


def check_setting_names(section: str, names: list[str]) -> None:
    known = [f.name for f in setting_fields(section, SECTIONS[section])]
    for name in sorted(set(names) - set(known)):
        raise SettingsError(f"unknown setting [{section}] {name} in the config files{closest(name, known)}")


def config_files(given: str | None = None) -> list[Path]:
    """The files a command reads, in order, each later one over the earlier: Luigi's defaults that exist,
    LUIGI_CONFIG_PATH, then `given`."""
    paths = [Path(p) for p in LUIGI_DEFAULT_FILES if Path(p).exists()]
    paths += [Path(p) for p in (os.environ.get("LUIGI_CONFIG_PATH"), given) if p]
    for path in paths:
        if path.suffix == ".toml":
            raise SettingsError(f"{path}: the library's commands read .cfg files; give the settings in one")
        if not path.is_file():
            raise SettingsError(f"{path}: no such config file")
    return paths


def parse_value(section: str, name: str, text: str, default: object) -> object:
    """A setting's text as its default's type, as Luigi's parameters parse it."""
    try:
        if isinstance(default, bool):
            if text.lower() not in ("true", "false"):
                raise ValueError(text)
            return text.lower() == "true"
        return type(default)(text)
    except ValueError:
        raise SettingsError(f"setting [{section}] {name} = {text!r}: must be {KINDS[type(default)]}") from None


def settings_from_files(paths: list[Path], overrides: dict[str, dict[str, str]] | None = None) -> RunSettings:
    """The RunSettings the files give, with `overrides` ({section: {name: text}}) over them."""
    parser = configparser.ConfigParser(interpolation=None)
    for path in paths:
        parser.read(path, encoding="utf-8")
    for section, values in (overrides or {}).items():
        parser[section] = {**(dict(parser[section]) if parser.has_section(section) else {}), **values}
    check_sections(parser.sections(), {name for name in parser.sections() if name[:1].isupper()})  # tasks' own
    values = {}
    for section, config in SECTIONS.items():
        given = dict(parser[section]) if parser.has_section(section) else {}
        check_setting_names(section, list(given))
        values[section] = config(
            **{
                f.name: parse_value(section, f.name, given[f.name], f.default)
                for f in setting_fields(section, config)
                if f.name in given and f.default is not MISSING
            }
        )
    return RunSettings(**values)
