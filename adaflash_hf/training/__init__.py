"""Offline training: the training wrapper, objective, collator, features and checkpoints
(``model``, ``objective``, ``collator``, ``features``, ``checkpoint``, ``losses``, ``blocks``), the
``transformers.Trainer`` glue (``trainer``) and the drafter's recipe (``train_drafter``)."""


class RecipeError(RuntimeError):
    """A training recipe cannot run as configured (a user-fixable problem; the message says what)."""


__all__ = ["RecipeError"]
