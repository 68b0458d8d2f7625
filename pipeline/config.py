"""The [retool] section of luigi.cfg: one Luigi parameter per RunSettings field, so every setting can
also be given on the command line as --retool-<name>."""

from dataclasses import fields

import luigi

from jobs.settings import RunSettings

_PARAMETER_TYPES = {bool: luigi.BoolParameter, int: luigi.IntParameter, float: luigi.FloatParameter, str: luigi.Parameter}

retool = type(
    "retool",
    (luigi.Config,),
    {field.name: _PARAMETER_TYPES[type(field.default)](default=field.default) for field in fields(RunSettings)},
)


def current_settings() -> RunSettings:
    config = retool()
    return RunSettings(**{field.name: getattr(config, field.name) for field in fields(RunSettings)})
