"""Errors a caller of the engine handles: a request it cannot serve as given."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine cannot serve as given (bad token ids, too long...); ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code
