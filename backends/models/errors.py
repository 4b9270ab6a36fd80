"""Errors raised while opening a model or rendering its chat template."""

from __future__ import annotations

from inferflux.backends.base import BackendError


class ModelLoadError(BackendError):
    """A model file or directory cannot be used: missing, corrupt, or of a kind we do not support.

    A subclass of ``BackendError`` so a backend's ``load`` can let it propagate unchanged; the
    message always names the offending path (and tensor or key, where there is one).
    """


class ChatTemplateError(ValueError):
    """The chat template failed to render, or the messages handed to it are malformed.

    A ``ValueError`` because it is nearly always the client's input (or a model's template)
    that is wrong, which the gateway maps to a 400 rather than a 500.
    """
