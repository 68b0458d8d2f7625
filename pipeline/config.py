"""The settings' sections as Luigi config classes: [rollout] group_size in luigi.cfg, or
--rollout-group-size on the command line. One class per RunSettings section, one parameter per field."""

import re
from dataclasses import MISSING
from functools import lru_cache

import luigi
import luigi.cmdline_parser
import luigi.task_register

from retool.config.files import KINDS, check_sections, check_setting_names
from retool.config.files import SECTIONS as SETTING_SECTIONS
from retool.config.settings import RunSettings, SettingsError, setting_fields

_PARAMETER_TYPES = {
    bool: luigi.BoolParameter,
    int: luigi.IntParameter,
    float: luigi.FloatParameter,
    str: luigi.Parameter,
}


def _parameter(default):
    """A setting's Luigi parameter; a boolean takes its value (`--model-use-tools false`), not a bare flag."""
    if isinstance(default, bool):
        return luigi.BoolParameter(default=default, parsing=luigi.BoolParameter.EXPLICIT_PARSING)
    return _PARAMETER_TYPES[type(default)](default=default)


def _section_class(section: str, config: type) -> type:
    parameters = {f.name: _parameter(f.default) for f in setting_fields(section, config) if f.default is not MISSING}
    return type(section, (luigi.Config,), {"__module__": __name__, **parameters})


# Each settings section: its dataclass and its Luigi config class.
SECTIONS = {name: (config, _section_class(name, config)) for name, config in SETTING_SECTIONS.items()}


def current_settings() -> RunSettings:
    """The settings as the config files and the command line give them now. Resolving Luigi
    parameters is slow and tasks ask often, so the result is cached for as long as the sections
    and the command line stay the same."""
    parser = luigi.configuration.get_config()
    sections = tuple(  # raw: no interpolation, much faster
        tuple(sorted(parser.items(name, raw=True))) if parser.has_section(name) else () for name in SECTIONS
    )
    return _settings(sections, tuple(parser.sections()), id(luigi.cmdline_parser.CmdlineParser.get_instance()))


@lru_cache(maxsize=8)
def _settings(sections: tuple, present: tuple[str, ...], command_line: int) -> RunSettings:
    check_sections(present, set(luigi.task_register.Register._get_reg()))  # the registered tasks' sections too
    for name, items in zip(SECTIONS, sections, strict=True):
        check_setting_names(name, [key for key, _ in items])
    values = {}
    for name, (config, luigi_class) in SECTIONS.items():
        try:
            parameters = luigi_class()
        except ValueError as error:  # Luigi could not parse a value: its parameter is named in the message
            raise _unparsable(name, error) from None
        values[name] = config(**{f.name: getattr(parameters, f.name) for f in setting_fields(name, config)})
    return RunSettings(**values)


def _unparsable(section: str, error: ValueError) -> SettingsError:
    name = re.search(r"value of '(\w+)'", str(error))
    if name is None:
        return SettingsError(f"setting [{section}]: {error}")
    name = name.group(1)
    command_line = luigi.cmdline_parser.CmdlineParser.get_instance()
    given = getattr(command_line.known_args, f"{section}_{name}", None) if command_line else None
    if given is None:
        given = luigi.configuration.get_config().get(section, name, None)
    default = next(f.default for f in setting_fields(section, SECTIONS[section][0]) if f.name == name)
    return SettingsError(f"setting [{section}] {name} = {given!r}: must be {KINDS.get(type(default), 'valid')}")
