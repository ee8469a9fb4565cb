"""Exceptions graphrt raises for problems a user can fix; each message names the problem."""


class GraphrtError(Exception):
    """Base class: the CLI prints these as one line, without a traceback."""


class ConfigError(GraphrtError, ValueError):
    """An engine or model setting is invalid or unsupported."""


class ModelLoadError(GraphrtError):
    """A model path, file or architecture cannot be loaded."""


class InvalidRequestError(GraphrtError, ValueError):
    """A request (prompt or sampling parameters) is invalid; nothing was enqueued. ``field``: the
    sampling parameter at fault, when one is (a server names it back to its client)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field
