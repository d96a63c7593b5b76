"""Write `.slimwhl/`, the transformers wheel the GPU scripts carry (`WHEELS=.slimwhl`), with only the model
folders the reference-pair runs import.

The device tool sends at most 64 MiB with the checkout; the full transformers 5.23 wheel (13 MB) does not fit
beside the tracked reference pair and `.devdata/data.tar.gz`, this one (2.2 MB) does. Kept model folders:
`auto` (the Auto* classes), `qwen3` / `qwen2` / `llama` / `mistral` (the targets the engine fuses),
`encoder_decoder` (imported by `AutoTokenizer`) and `bloom` (imported by peft).

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux2014_x86_64 -d .whl transformers==5.23.0
    python examples/reference_pair/slim_wheel.py .whl/transformers-5.23.0-py3-none-any.whl --out .slimwhl
"""

import argparse
import os
import tempfile
import zipfile
from pathlib import Path

KEEP = ("auto", "bloom", "encoder_decoder", "llama", "mistral", "qwen2", "qwen3")


def kept(name: str) -> bool:
    """Whether a wheel member stays: everything outside `transformers/models/<model>/`, and the kept models."""
    parts = name.split("/")
    return not (len(parts) > 3 and parts[:2] == ["transformers", "models"]) or parts[2] in KEEP


def slim(wheel: Path, out_dir: Path) -> Path:
    """Copy ``wheel`` into ``out_dir`` without the other model folders; RECORD lists exactly what is left."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / wheel.name
    with zipfile.ZipFile(wheel) as src:
        names = [n for n in src.namelist() if kept(n)]
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        lines = src.read(record).decode().splitlines(keepends=True)
        kept_names = set(names)
        fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".part")
        os.close(fd)
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
            for n in names:
                data = src.read(n) if n != record else "".join(l for l in lines if l.split(",")[0] in kept_names).encode()
                dst.writestr(src.getinfo(n), data)
    os.replace(tmp, out)  # atomic: a stopped run leaves no half-written wheel under the name pip reads
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheel", type=Path, help="the transformers wheel (pip download, above)")
    ap.add_argument("--out", type=Path, default=Path(".slimwhl"))
    args = ap.parse_args()
    out = slim(args.wheel, args.out)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
