"""Errors a user can act on. Their message is one line that says what is wrong and what to do."""

from __future__ import annotations


class UserError(Exception):
    """Base for every error the CLI prints as one line (no traceback)."""


class ModelError(UserError):
    """A model file is missing, corrupt, not a GGUF, or could not be fetched."""


class IncompatibleTokenizer(UserError):
    """A draft model whose tokenizer differs from the target's."""


class NoFimTokens(UserError):
    """Fill-in-the-middle asked of a model whose vocabulary has no FIM tokens."""


class PeerError(UserError):
    """The bench's llama-server peer could not be built, started or asked."""
