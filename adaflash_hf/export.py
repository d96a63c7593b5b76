"""Export drafters for serving engines that outgrow one machine (SGLang, vLLM)."""

from .modeling import AdaFlashDrafter, write_dflash_checkpoint


def export_dflash(drafter: AdaFlashDrafter, path: str) -> str:
    """Write `drafter` in the z-lab DFlash layout that SGLang and vLLM load.

    SGLang: `--speculative-algorithm DFLASH --speculative-draft-model-path PATH`; vLLM:
    `speculative_config={"method": "dflash", "model": PATH}`. The length head, when present, is
    written under the released AdaFlash key names (`thresh_head_two_model.*`); both engines ignore
    it. The export is atomic: `path` appears complete or not at all.

    Example:
        >>> export_dflash(drafter, "out/my-drafter-dflash")  # doctest: +SKIP
    """
    if not isinstance(drafter, AdaFlashDrafter):
        raise TypeError(f"export_dflash expects an AdaFlashDrafter, got {type(drafter).__name__}")
    write_dflash_checkpoint(drafter, path)
    return str(path)
