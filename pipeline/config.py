"""The [retool] section of luigi.cfg: one Luigi parameter per RunSettings field, so every setting can
also be given on the command line as --retool-<name>."""

from dataclasses import fields
from functools import lru_cache

import luigi
import luigi.cmdline_parser

from jobs.settings import RunSettings

_PARAMETER_TYPES = {
    bool: luigi.BoolParameter,
    int: luigi.IntParameter,
    float: luigi.FloatParameter,
    str: luigi.Parameter,
}

retool = type(
    "retool",
    (luigi.Config,),
    {field.name: _PARAMETER_TYPES[type(field.default)](default=field.default) for field in fields(RunSettings)},
)


def current_settings() -> RunSettings:
    """The settings as luigi.cfg (and the command line) give them now. Resolving Luigi parameters
    is slow and tasks ask often, so the result is cached for as long as the [retool] section and
    the command line stay the same."""
    parser = luigi.configuration.get_config()
    section = (
        tuple(sorted(parser.items("retool", raw=True))) if parser.has_section("retool") else ()
    )  # raw: no interpolation, much faster
    command_line = luigi.cmdline_parser.CmdlineParser.get_instance()
    return _settings(section, id(command_line))


@lru_cache(maxsize=8)
def _settings(section: tuple, command_line: int) -> RunSettings:
    config = retool()
    return RunSettings(**{field.name: getattr(config, field.name) for field in fields(RunSettings)})
