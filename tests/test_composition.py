"""No class of the package takes its state from a mixin in another file: a base class defined in another module of
the package owns (defines, assigns or declares) every attribute it reads through ``self``. A base that reads what
only its subclass sets is a mixin sharing state across files; such parts are composed instead (the online adapter's
``UpdateLoop``, the server's ``ResponseShapes``, the trainer process around its ``ShadowTrainer``)."""

from __future__ import annotations

import ast
from pathlib import Path

from test_package_layout import package_modules

def _bound_names(tree: ast.Module, package: str, modules) -> dict[str, str]:
    """Names this module binds by ``from X import name`` to the package module defining them."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            if base in modules:
                for a in node.names:
                    out[a.asname or a.name] = base
    return out


def _owned(cls: ast.ClassDef) -> set[str]:
    """What a class defines itself: methods, class-level names and annotations, and every ``self.x`` it assigns."""
    owned = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            owned.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            owned.add(node.target.id)
        elif isinstance(node, ast.Assign):
            owned.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []  # fmt: skip
        for t in targets:
            for leaf in ast.walk(t):
                if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and leaf.value.id == "self":
                    owned.add(leaf.attr)
    return owned


def _reads(cls: ast.ClassDef) -> set[str]:
    return {n.attr for n in ast.walk(cls)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"}  # fmt: skip


def mixins(modules: dict[str, tuple[Path, bool]]) -> list[str]:
    """``subclass (module) <- base (module): attributes`` for each class whose base from another module of
    ``modules`` reads through ``self`` attributes that base does not own."""
    trees = {name: ast.parse(path.read_text(), str(path)) for name, (path, _) in modules.items()}
    classes = {(name, n.name): n for name, tree in trees.items() for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    hits = []
    for name, tree in trees.items():
        package = name if modules[name][1] else name.rpartition(".")[0]
        bound = _bound_names(tree, package, modules)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            for base in node.bases:
                if not isinstance(base, ast.Name) or base.id not in bound:
                    continue
                found = classes.get((bound[base.id], base.id))
                if found is None:
                    continue
                missing = sorted(a for a in _reads(found) - _owned(found) if not a.startswith("__"))
                if missing:
                    hits.append(f"{node.name} ({name}) <- {base.id} ({bound[base.id]}): {', '.join(missing)}")
    return hits


def test_no_class_takes_its_state_from_a_mixin_in_another_file():
    modules = package_modules()
    hits = mixins(modules)
    assert hits == [], "\n".join(hits)


def test_the_check_finds_a_mixin_and_passes_composition(tmp_path):
    """The control: a base reading what only its subclass assigns is found; a base declaring the fields it reads,
    and a class holding its part as an attribute, are not."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "parts.py").write_text(
        "class Shapes:\n    def body(self):\n        return self.model_name\n"
        "class Tally:\n    accepted: list\n    def total(self):\n        return sum(self.accepted)\n"
        "class Owned:\n    def __init__(self, name):\n        self.name = name\n    def body(self):\n        return self.name\n")
    (pkg / "service.py").write_text(
        "from .parts import Owned, Shapes, Tally\n"
        "class Service(Shapes):\n    def __init__(self):\n        self.model_name = 'm'\n"
        "class Stats(Tally):\n    accepted = []\n"
        "class Composed:\n    def __init__(self):\n        self.shapes = Owned('m')\n")
    modules = {"pkg": (pkg / "__init__.py", True), **{f"pkg.{m}": (pkg / f"{m}.py", False) for m in ("parts", "service")}}
    assert mixins(modules) == ["Service (pkg.service) <- Shapes (pkg.parts): model_name"]
