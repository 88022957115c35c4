"""Errors a user can act on. Their message is one line that says what is wrong and what to do."""

from __future__ import annotations


class UserError(Exception):
    """Base for every error the CLI prints as one line (no traceback). param: the request field
    it is about, where a request caused it (the API error's `param`)."""

    param: str | None = None  # (a subclass with an __init__ of its own keeps this)

    def __init__(self, *args: object, param: str | None = None) -> None:
        super().__init__(*args)
        self.param = param


class ModelError(UserError):
    """A model file is missing, corrupt, not a GGUF, or could not be fetched."""


class IncompatibleTokenizer(UserError):
    """A draft model whose tokenizer differs from the target's."""


class NoFimTokens(UserError):
    """Fill-in-the-middle asked of a model whose vocabulary has no FIM tokens."""


class PeerError(UserError):
    """The bench's llama-server peer could not be built, started or asked."""
