"""The one error every loader raises."""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model could not be loaded. The message is one line naming the file and the problem."""
