"""`examples/reference_pair/slim_wheel.py`: the carried transformers wheel keeps what the GPU runs import."""

import importlib.util
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "reference_pair" / "slim_wheel.py"
spec = importlib.util.spec_from_file_location("slim_wheel", SCRIPT)
slim_wheel = importlib.util.module_from_spec(spec)
spec.loader.exec_module(slim_wheel)

MEMBERS = {  # member -> kept?
    "transformers/__init__.py": True,
    "transformers/models/__init__.py": True,
    "transformers/models/auto/tokenization_auto.py": True,
    "transformers/models/encoder_decoder/__init__.py": True,
    "transformers/models/qwen3/modeling_qwen3.py": True,
    "transformers/models/bloom/__init__.py": True,
    "transformers/models/bert/modeling_bert.py": False,
    "transformers/models/whisper/__init__.py": False,
    "transformers/generation/utils.py": True,
}


@pytest.mark.parametrize("member, keep", sorted(MEMBERS.items()))
def test_kept(member, keep):
    assert slim_wheel.kept(member) is keep


def test_slim_wheel_drops_other_models_and_their_record_lines(tmp_path):
    wheel = tmp_path / "transformers-0.0-py3-none-any.whl"
    record = "transformers-0.0.dist-info/RECORD"
    with zipfile.ZipFile(wheel, "w") as z:
        for m in MEMBERS:
            z.writestr(m, f"# {m}\n")
        z.writestr(record, "".join(f"{m},sha256=x,1\n" for m in MEMBERS) + f"{record},,\n")
    out = slim_wheel.slim(wheel, tmp_path / "slim")
    with zipfile.ZipFile(out) as z:
        names = set(z.namelist())
        lines = z.read(record).decode().splitlines()
    assert names == {m for m, keep in MEMBERS.items() if keep} | {record}
    assert {line.split(",")[0] for line in lines} == names
    assert list((tmp_path / "slim").iterdir()) == [out]  # no temporary file left beside it
