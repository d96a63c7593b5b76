"""Offline training: the training wrapper, objective, collator, features and checkpoints
(``model``, ``objective``, ``collator``, ``features``, ``checkpoint``, ``losses``, ``blocks``), the
``transformers.Trainer`` glue (``trainer``) and the recipes (``train_drafter``, ``train_target``)."""


class RecipeError(RuntimeError):
    """A training recipe cannot run as configured (a user-fixable problem; the message says what)."""


__all__ = ["RecipeError"]
