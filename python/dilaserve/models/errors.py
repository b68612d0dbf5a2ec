"""The one exception type every checkpoint problem surfaces as."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint directory is incomplete, inconsistent or of an unsupported kind.

    The message always names the offending file, so an operator can fix the directory.
    """
