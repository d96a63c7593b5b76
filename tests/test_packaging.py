"""The wheel must carry every subpackage: pyproject lists them explicitly (modeling/ and hub_cards/
are mapped in from the top level), so a new subpackage that is not listed would vanish on install."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "adaflash_hf").rglob("__init__.py")}
    mapped = {name for name in config["package-dir"] if name != "adaflash_hf"}
    assert on_disk - listed == set(), f"subpackages missing from pyproject [tool.setuptools] packages: {on_disk - listed}"
    assert mapped <= listed
    for name, folder in config["package-dir"].items():
        assert (ROOT / folder).is_dir(), f"{name} maps to missing folder {folder}"
