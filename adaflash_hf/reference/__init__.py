"""The project's embedded reference pair: a small Qwen3 target and its AdaFlash drafter.

Both were trained on this project's own data (no hub is reachable where they were made): the target
with `examples/reference_pair/gpu_run.sh`, the drafter (v9: 5 layers, all four domains) with
`bash examples/reference_pair/gpu_drafters.sh four` and nine chained continuations of it (the last five on
prompts of up to 1,536 tokens).
"""

import os

import torch

REFERENCE_DIR = os.path.dirname(os.path.abspath(__file__))


def load_reference_pair(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"):
    """Load `(target, drafter, tokenizer)` offline from the files shipped in the package.

    Example:
        >>> from adaflash_hf import load_reference_pair
        >>> target, drafter, tok = load_reference_pair()
        >>> inputs = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
        ...                                  return_dict=True, return_tensors="pt")
        >>> out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=32)  # doctest: +SKIP
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..modeling import AdaFlashDrafter

    target_dir, drafter_dir = os.path.join(REFERENCE_DIR, "target"), os.path.join(REFERENCE_DIR, "drafter")
    for d in (target_dir, drafter_dir):
        if not os.path.isfile(os.path.join(d, "config.json")):
            raise FileNotFoundError(f"reference model files are missing at {d}: reinstall adaflash-hf from a full checkout")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype, attn_implementation=attn_implementation).to(device).eval()
    drafter = AdaFlashDrafter.from_pretrained(drafter_dir, dtype=dtype, attn_implementation=attn_implementation).to(device).eval()
    return target, drafter.bind_target(target), tokenizer


__all__ = ["REFERENCE_DIR", "load_reference_pair"]
