"""Errors that mean "the caller's input cannot be used", shared by every part of the compressor.

Whoever runs a job maps `InputError` (and only it) to a caller's mistake (exit 2, INVALID_ARGUMENT);
anything else escaping the compressor is a bug and is reported as internal.
"""

from __future__ import annotations


class InputError(ValueError):
    """Input that cannot be used; the message says what was expected."""


class CalibrationError(InputError):
    """Calibration or evaluation data that cannot be used."""


class ModelReferenceError(InputError):
    """A model reference that cannot be resolved."""


class UnsupportedArchitecture(ModelReferenceError):
    """A model that loads but whose architecture no pipeline here prunes."""


class SurgeryError(InputError):
    """Indices or shapes that surgery cannot apply (every bad index listed)."""
