"""The one place adaflash-hf reaches into transformers' generation, and why.

transformers offers no public hook to choose a candidate generator per assistant model, and its
assisted loop is batch-1 and commits tokens past a stop string. We therefore wrap
`GenerationMixin.generate` once: when `assistant_model` is an AdaFlash drafter, the call is
re-issued through generate's *public* `custom_generate` seam with our decoding loop
(`adaflash_decoding`), so transformers still prepares the config, processors, stopping criteria
and cache. Every other call is passed through untouched. `tests/test_hf_integration.py` fails
loudly if the seams we rely on change. Details: docs/transformers_internals.md.
"""

import functools
import inspect

import transformers
from transformers.generation.utils import GenerationMixin

from ..modeling import AdaFlashDrafter
from .decoding import adaflash_decoding

TESTED_TRANSFORMERS = ((5, 23),)
_OPTIONS = ("length_policy", "length_rate", "length_min", "return_stats", "round_sink")


def check_transformers_version(version: str = transformers.__version__) -> None:
    """Refuse an untested transformers major version with a clear message."""
    major, minor = (int(x) for x in version.split(".")[:2])
    if major not in {m for m, _ in TESTED_TRANSFORMERS}:
        tested = ", ".join(f"{a}.{b}" for a, b in TESTED_TRANSFORMERS)
        raise ImportError(
            f"adaflash-hf is tested with transformers {tested}; found {version}, an untested major version. "
            f"Install a tested release: pip install 'transformers>=5.23,<5.24'"
        )


def _speculative_generate_method(generate):
    @functools.wraps(generate)
    def wrapper(self, inputs=None, generation_config=None, *args, assistant_model=None, streamer=None, **kwargs):
        native = kwargs.get("speculation_type", getattr(generation_config, "speculation_type", None)) == "dflash"
        if not isinstance(assistant_model, AdaFlashDrafter) or native:
            if any(k in kwargs for k in _OPTIONS):
                raise ValueError(f"{', '.join(k for k in _OPTIONS if k in kwargs)} need an AdaFlash drafter as assistant_model")
            return generate(self, inputs, generation_config, *args, assistant_model=assistant_model, streamer=streamer, **kwargs)
        if kwargs.get("custom_generate") is not None:
            raise ValueError("pass either assistant_model=<AdaFlash drafter> or custom_generate, not both")
        if not assistant_model.has_target:
            assistant_model.bind_target(self)
        decode = functools.partial(adaflash_decoding, drafter=assistant_model, streamer=streamer)
        options = {k: kwargs.pop(k) for k in _OPTIONS if k in kwargs}
        if options:
            decode = functools.partial(decode, **options)
        return generate(self, inputs, generation_config, *args, streamer=streamer, custom_generate=decode, **kwargs)

    wrapper.__adaflash_hook__ = True
    return wrapper


def install_generate_hook() -> None:
    """Route `generate(assistant_model=<AdaFlash drafter>)` to our loop. Idempotent."""
    check_transformers_version()
    current = GenerationMixin.generate
    if getattr(current, "__adaflash_hook__", False):
        return
    params = inspect.signature(current).parameters
    missing = [p for p in ("custom_generate", "assistant_model", "streamer", "generation_config") if p not in params]
    if missing:
        raise ImportError(f"transformers.GenerationMixin.generate lacks {missing}: this transformers is not supported")
    GenerationMixin.generate = _speculative_generate_method(current)
