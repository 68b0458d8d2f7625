"""The settings' sections as Luigi config classes: [rollout] group_size in luigi.cfg, or
--rollout-group-size on the command line. One class per RunSettings section, one parameter per field."""

from dataclasses import MISSING, fields
from functools import lru_cache

import luigi
import luigi.cmdline_parser

from retool.config.settings import RunSettings, SettingsError, setting_fields

_PARAMETER_TYPES = {
    bool: luigi.BoolParameter,
    int: luigi.IntParameter,
    float: luigi.FloatParameter,
    str: luigi.Parameter,
}


def _section_class(section: str, config: type) -> type:
    parameters = {
        f.name: _PARAMETER_TYPES[type(f.default)](default=f.default)
        for f in setting_fields(section, config)
        if f.default is not MISSING
    }
    return type(section, (luigi.Config,), {"__module__": __name__, **parameters})


SECTIONS = {
    f.name: (f.default_factory, _section_class(f.name, f.default_factory))
    for f in fields(RunSettings)  # each section's dataclass is its field's default factory
}


def current_settings() -> RunSettings:
    """The settings as the config files and the command line give them now. Resolving Luigi
    parameters is slow and tasks ask often, so the result is cached for as long as the sections
    and the command line stay the same."""
    parser = luigi.configuration.get_config()
    sections = tuple(  # raw: no interpolation, much faster
        tuple(sorted(parser.items(name, raw=True))) if parser.has_section(name) else () for name in SECTIONS
    )
    return _settings(sections, id(luigi.cmdline_parser.CmdlineParser.get_instance()))


@lru_cache(maxsize=8)
def _settings(sections: tuple, command_line: int) -> RunSettings:
    for name, items in zip(SECTIONS, sections, strict=True):
        known = {f.name for f in setting_fields(name, SECTIONS[name][0])}
        unknown = sorted({key for key, _ in items} - known)
        if unknown:
            raise SettingsError(
                f"unknown setting(s) {', '.join(unknown)} in section [{name}] of the config files; its settings are "
                f"{', '.join(sorted(known))}"
            )
    values = {}
    for name, (config, luigi_class) in SECTIONS.items():
        parameters = luigi_class()
        try:
            values[name] = config(**{f.name: getattr(parameters, f.name) for f in setting_fields(name, config)})
        except SettingsError:
            raise
        except ValueError as error:
            raise SettingsError(f"setting [{name}]: {error}") from None
    return RunSettings(**values)
