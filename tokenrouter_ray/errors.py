"""Errors whose message is the whole story: the CLI prints them without a traceback."""

from __future__ import annotations


class UserFacingError(Exception):
    """A configuration or environment problem the user can fix from the message alone."""


class ModelLoadError(UserFacingError):
    """A model directory or hub id that cannot be loaded as a causal LM."""
