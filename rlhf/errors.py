"""Errors a user can cause (config, data, paths): raised early as one sentence, never retried."""


class UserInputError(ValueError):
    """Base class: retrying cannot fix these."""


class ConfigError(UserInputError):
    """A configuration that cannot be used; the message names the key."""


class DataError(UserInputError):
    """Preference data that cannot be used; the message names the file, column or row."""
