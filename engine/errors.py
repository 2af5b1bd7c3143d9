"""Exceptions raised by the engine. Each carries a message meant to be shown to a user as is."""


class SpeedupLabError(ValueError):
    """Base class: bad input or an unusable model, with a human-readable message."""


class ModelLoadError(SpeedupLabError):
    """A model id or folder could not be loaded (not cached offline, missing files, not a causal LM)."""


class TokenizerMismatchError(SpeedupLabError):
    """The draft's tokenizer does not map text to the same ids as the target's."""


class InputError(SpeedupLabError):
    """A generation argument is out of range (empty prompt, γ < 1, top-p outside (0, 1], ...)."""
