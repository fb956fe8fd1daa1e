"""Errors a user can cause. Each carries one sentence that names the bad thing.

They are raised where input enters (file load, CLI, HTTP) and turned into a one-line message and
exit status 2 by the CLI, or into the OpenAI error schema by the server. Our own bugs are not
wrapped in these.
"""


class MoestreamError(Exception):
    """Base class for errors caused by input (files, arguments, requests)."""

    exit_code = 2


class ModelFormatError(MoestreamError):
    """A model file or folder is corrupt, truncated, inconsistent or of an unknown kind."""


class UnsupportedError(MoestreamError):
    """Valid input that this build does not support (a quant type, an architecture)."""


class RequestError(MoestreamError):
    """A request is invalid: bad sampling parameter, prompt too long, impossible budget."""


class CapacityError(MoestreamError):
    """A request can never fit in the configured memory budgets."""
