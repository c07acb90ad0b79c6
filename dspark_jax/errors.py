"""Errors a user can cause. Each message names the file, key or value and what was expected."""


class DSparkError(ValueError):
    """Base class for errors caused by user input (files, configs, flags)."""


class ConfigError(DSparkError):
    """A config file, preset or override is unknown, mistyped or inconsistent."""


class CheckpointError(DSparkError):
    """A checkpoint directory or file is missing, malformed or does not fit the model."""


class DataError(DSparkError):
    """A data or prompt file is missing or malformed."""
