"""Online adaptation: the drafter keeps learning from the target's verification while it serves.

    python examples/online_adaptation.py --output-dir runs/online                     # local versions
    python examples/online_adaptation.py --output-dir runs/online --hub-repo me/drafter-online   # + Hub pushes
    python examples/online_adaptation.py --smoke                                      # a few seconds

An `OnlineAdapter` attached to the drafter receives every request served by
`target.generate(..., assistant_model=drafter)`, buffers them, and trains a shadow copy of the
drafter in a background thread on the target's distributions over each whole sequence (on-policy
distillation, SPEC section 4). Each update is swapped
in between rounds, written atomically as a numbered version (`v00001/`, ..., `LATEST`), and, with
`--hub-repo`, pushed to the Hub with a model card (credentials from `HF_TOKEN` or `hf auth login`;
pushes retry in the background and never block generation). Outputs stay exactly the target's.
"""

import argparse
import tempfile

import torch

from adaflash_hf import load_reference_pair
from adaflash_hf.online import OnlineAdapter, OnlineConfig, latest_version, list_versions

PROMPTS = [
    "Write a Python function that returns the largest item of a list.",
    "Write a Python function that counts the vowels in a string.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that sums the even numbers of a list.",
    "Write a Python function that reverses the words of a sentence.",
    "Write a Python function that returns the factorial of n.",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny settings (2 prompts, 24 tokens, an update after each request)")
    ap.add_argument("--output-dir", default=None, help="where versions are written (default: a temporary folder)")
    ap.add_argument("--hub-repo", default=None, help="also push every version to this Hub repo (org/name)")
    ap.add_argument("--samples-per-update", type=int, default=2, help="finished requests per update (paper: 128)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    torch.set_num_threads(1)
    prompts = PROMPTS[:2] if args.smoke else PROMPTS
    max_new, per_update = (24, 1) if args.smoke else (args.max_new_tokens, args.samples_per_update)
    tmp = None if args.output_dir else tempfile.TemporaryDirectory(prefix="adaflash-online-")
    output_dir = args.output_dir or tmp.name

    target, drafter, tok = load_reference_pair()
    encode = lambda p: tok.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    plain = {p: target.generate(encode(p), max_new_tokens=max_new, do_sample=False) for p in prompts}

    config = OnlineConfig(
        method="opd", samples_per_update=per_update, epochs=1,
        output_dir=output_dir, keep_versions=3, hub_repo=args.hub_repo,
        target_name="adaflash-hf reference target",
    )  # fmt: skip
    adapter = OnlineAdapter(drafter, target, config)
    adapter.attach()  # every generate(..., assistant_model=drafter) now feeds the adapter
    identical = True
    for p in prompts:
        adapter.set_domain("code")
        out = target.generate(encode(p), assistant_model=drafter, max_new_tokens=max_new, do_sample=False)
        identical &= torch.equal(out, plain[p])  # lossless whatever the drafter weights are
        adapter.wait_for_update()  # only to make this example reproducible; serving never waits
        s = adapter.stats
        tau = "-" if s["tau_since_update"] is None else f"{s['tau_since_update']:.2f}"
        print(f"served {p[:50]!r}: {s['updates']} update(s) so far, tau since the last swap {tau}")
    adapter.close(flush=True)  # train on what is left, write that version; Hub pushes get hub_timeout (10 s)

    stats = adapter.stats
    for h in stats["history"]:
        after = "-" if h["tau_after"] is None else f"{h['tau_after']:.2f}"
        print(f"update {h['update']} -> version {h['version']}: {h['samples']} samples, "
              f"tau before {h['tau_before']:.2f}, tau after {after}")
    print(f"versions: {[p.name for _, p in list_versions(output_dir)]}, latest {latest_version(output_dir)}")
    if stats["hub"] is not None:
        print(f"hub: {stats['hub']}")
    print(f"identical: {identical}")
    if tmp is not None:
        tmp.cleanup()
    return 0 if identical and stats["updates"] > 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
