"""The one place adaflash-hf reaches into transformers' generation, and why.

transformers offers no public hook to choose a candidate generator per assistant model, and its
assisted loop is batch-1 and commits tokens past a stop string. We therefore wrap
`GenerationMixin.generate` once: when `assistant_model` is an AdaFlash drafter, the call is
re-issued through generate's *public* `custom_generate` seam with our decoding loop
(`adaflash_decoding`), so transformers still prepares the config, processors, stopping criteria
and cache. With `speculation_type="adaflash"` the call instead goes to transformers' own
`_assisted_decoding` with our `AdaFlashCandidateGenerator` (a wrapped `_get_candidate_generator`
builds it). Every other call is passed through untouched. `tests/test_hf_integration.py` fails
loudly if the seams we rely on change. Details: docs/transformers_internals.md.
"""

import contextvars
import functools
import inspect

import transformers
from transformers.generation.stopping_criteria import StoppingCriteriaList, StopStringCriteria
from transformers.generation.utils import GenerationMixin

from ..modeling import AdaFlashDrafter
from .decoding import adaflash_decoding
from .drafting import AdaFlashCandidateGenerator

TESTED_TRANSFORMERS = ((5, 23),)
_OPTIONS = ("length_policy", "length_rate", "length_min", "return_stats", "round_sink", "fast_path")
_POLICY_OPTIONS = ("length_policy", "length_rate", "length_min")  # what transformers' own loop can use too
ADAFLASH_SPECULATION = "adaflash"
# `generate` has no way to hand call options to `_get_candidate_generator`; the hook sets them for
# the duration of one `generate(..., speculation_type="adaflash")` call (per thread / task).
_HF_ROUTE_OPTIONS: contextvars.ContextVar[dict] = contextvars.ContextVar("adaflash_hf_route_options", default={})


def check_transformers_version(version: str = transformers.__version__) -> None:
    """Refuse an untested transformers major version with a clear message."""
    major, minor = (int(x) for x in version.split(".")[:2])
    if major not in {m for m, _ in TESTED_TRANSFORMERS}:
        tested = ", ".join(f"{a}.{b}" for a, b in TESTED_TRANSFORMERS)
        raise ImportError(
            f"adaflash-hf is tested with transformers {tested}; found {version}, an untested major version. "
            f"Install a tested release: pip install 'transformers>=5.23,<5.24'"
        )


def _is_our_loop(custom_generate) -> bool:
    while isinstance(custom_generate, functools.partial):
        custom_generate = custom_generate.func
    return custom_generate is adaflash_decoding


def _stop_strings_to_criteria(self, generation_config, kwargs) -> None:
    """transformers gives a callable `custom_generate` no `tokenizer` (it builds the generation-mode
    kwargs from the callable's own new parameters only), so `stop_strings` would fail with "could not
    locate a tokenizer": build the `StopStringCriteria` here and pass it as a stopping criterion."""
    tokenizer = kwargs.pop("tokenizer", None)
    config = generation_config if generation_config is not None else self.generation_config
    stop = kwargs["stop_strings"] if "stop_strings" in kwargs else getattr(config, "stop_strings", None)
    if stop is None or tokenizer is None:  # without a tokenizer transformers raises its own clear error
        return
    criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(stop_strings=stop, tokenizer=tokenizer))
    kwargs["stopping_criteria"] = criteria
    kwargs["stop_strings"] = None


def _transformers_route(generate, self, inputs, generation_config, args, assistant_model, kwargs):
    """`speculation_type="adaflash"`: transformers' own batch-1 `_assisted_decoding`, our candidates."""
    if not isinstance(assistant_model, AdaFlashDrafter):
        raise ValueError(f'speculation_type="{ADAFLASH_SPECULATION}" needs an AdaFlash drafter as assistant_model')
    unsupported = [k for k in _OPTIONS if k in kwargs and k not in _POLICY_OPTIONS]
    if unsupported:
        raise ValueError(
            f'{", ".join(unsupported)} need adaflash-hf\'s own loop: drop speculation_type="{ADAFLASH_SPECULATION}"'
        )
    if not assistant_model.is_bound_to(self):
        assistant_model.bind_target(self)
    token = _HF_ROUTE_OPTIONS.set({k: kwargs.pop(k) for k in _POLICY_OPTIONS if k in kwargs})
    try:
        return generate(self, inputs, generation_config, *args, assistant_model=assistant_model, **kwargs)
    finally:
        _HF_ROUTE_OPTIONS.reset(token)


def _speculative_generate_method(generate):
    @functools.wraps(generate)
    def wrapper(self, inputs=None, generation_config=None, *args, assistant_model=None, streamer=None, **kwargs):
        speculation = kwargs.get("speculation_type", getattr(generation_config, "speculation_type", None))
        if speculation == ADAFLASH_SPECULATION:
            return _transformers_route(generate, self, inputs, generation_config, args, assistant_model, dict(kwargs, streamer=streamer))
        native = speculation == "dflash"
        if _is_our_loop(kwargs.get("custom_generate")) and not isinstance(assistant_model, AdaFlashDrafter):
            # Direct `custom_generate=adaflash_decoding`: transformers would drop the streamer and the
            # tokenizer on the way to a callable; hand them over as the hook does.
            _stop_strings_to_criteria(self, generation_config, kwargs)
            if streamer is not None:
                kwargs["custom_generate"] = functools.partial(kwargs["custom_generate"], streamer=streamer)
            return generate(self, inputs, generation_config, *args, assistant_model=assistant_model, streamer=streamer, **kwargs)
        if not isinstance(assistant_model, AdaFlashDrafter) or native:
            if any(k in kwargs for k in _OPTIONS):
                raise ValueError(f"{', '.join(k for k in _OPTIONS if k in kwargs)} need an AdaFlash drafter as assistant_model")
            return generate(self, inputs, generation_config, *args, assistant_model=assistant_model, streamer=streamer, **kwargs)
        if kwargs.get("custom_generate") is not None:
            raise ValueError("pass either assistant_model=<AdaFlash drafter> or custom_generate, not both")
        if not assistant_model.is_bound_to(self):
            # Draft with the embedding / LM head of the target being decoded, not a look-alike's.
            assistant_model.bind_target(self)
        _stop_strings_to_criteria(self, generation_config, kwargs)
        decode = functools.partial(adaflash_decoding, drafter=assistant_model, streamer=streamer)
        options = {k: kwargs.pop(k) for k in _OPTIONS if k in kwargs}
        if options:
            decode = functools.partial(decode, **options)
        return generate(self, inputs, generation_config, *args, streamer=streamer, custom_generate=decode, **kwargs)

    wrapper.__adaflash_hook__ = True
    return wrapper


def _candidate_generator_method(get_candidate_generator):
    signature = inspect.signature(get_candidate_generator)

    @functools.wraps(get_candidate_generator)
    def wrapper(self, *args, **kwargs):
        call = signature.bind(self, *args, **kwargs).arguments
        config, drafter = call["generation_config"], call.get("assistant_model")
        if config.speculation_type != ADAFLASH_SPECULATION or not isinstance(drafter, AdaFlashDrafter):
            return get_candidate_generator(self, *args, **kwargs)
        return AdaFlashCandidateGenerator.for_target(self, drafter, config, call["logits_processor"], **_HF_ROUTE_OPTIONS.get())

    wrapper.__adaflash_hook__ = True
    return wrapper


def _wrap_once(name: str, make_wrapper, needs: tuple[str, ...]) -> None:
    """Replace `GenerationMixin.<name>` by `make_wrapper(original)` unless that was done already."""
    current = getattr(GenerationMixin, name)
    if getattr(current, "__adaflash_hook__", False):
        return
    missing = [p for p in needs if p not in inspect.signature(current).parameters]
    if missing:
        raise ImportError(f"transformers.GenerationMixin.{name} lacks {missing}: this transformers is not supported")
    setattr(GenerationMixin, name, make_wrapper(current))


def install_generate_hook() -> None:
    """Route `generate(assistant_model=<AdaFlash drafter>)` to our loop, and `speculation_type="adaflash"`
    to transformers' assisted loop with our candidate generator. Idempotent."""
    check_transformers_version()
    _wrap_once("generate", _speculative_generate_method, ("custom_generate", "assistant_model", "streamer", "generation_config"))
    _wrap_once(
        "_get_candidate_generator",
        _candidate_generator_method,
        ("generation_config", "assistant_model", "logits_processor"),
    )
