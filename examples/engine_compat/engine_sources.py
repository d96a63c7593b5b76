"""The engines' Python sources without their installs: the wheels fetched without dependencies and
unpacked (no compiled extensions), stubs for the third-party modules they import that this machine
lacks, and a one-rank tensor-parallel world. Used by `check_vllm_sglang.py`."""

from __future__ import annotations

import glob
import importlib
import importlib.abc
import importlib.machinery
import os
import subprocess
import sys
import types
import zipfile

ENGINE_ROOTS = ("vllm", "sglang")


# ----------------------------------------------------------------------------- stubs for absent third-party modules
class _AnyMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub

    def __getitem__(cls, item):
        return _Stub

    def __or__(cls, other):
        return _Stub

    __ror__ = __or__

    def __iter__(cls):
        return iter(())


class _Stub(metaclass=_AnyMeta):
    """Stands for any attribute of a module this environment lacks (only used at import time)."""

    def __init_subclass__(cls, **kwargs):
        pass

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):
        from pydantic_core import core_schema

        return core_schema.any_schema()

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Stub()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub()

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False


class MissingModuleStubber(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on `sys.meta_path`: answers only for top-level third-party modules nothing else could find."""

    # Modules the engines import at module level for serving (networking, serialization, grammars, ...),
    # none of which the model classes or their weight loading use. GPU / platform probes (pynvml,
    # amdsmi, flashinfer, ...) stay missing, so both engines see the CPU platform they run on here.
    allowed = {
        "zmq", "urllib3", "cbor2", "aiohttp", "requests", "openai_harmony", "openai", "pybase64", "cachetools",
        "cloudpickle", "uvloop", "cpuinfo", "prometheus_client", "xgrammar", "fastapi",
        "partial_json_parser", "llguidance", "einops", "dill", "orjson", "starlette", "uvicorn", "setproctitle",
        "IPython", "outlines", "compressed_tensors", "gguf", "sentencepiece", "torchvision", "pydantic_settings",
        "blobfile", "pillow", "PIL", "interegular", "decord", "soundfile", "torchao", "hf_transfer", "modelscope",
        "anthropic", "tiktoken", "xxhash", "pybind11", "nvtx", "psutil", "sgl_kernel", "ray", "watchfiles",
        "python_multipart", "multipart", "httpx", "anyio", "prometheus_fastapi_instrumentator", "lark", "jinja2",
        "tabulate", "mistral_common", "tvm_ffi", "timm", "scipy", "librosa", "av", "smg_grpc_proto", "grpc", "grpcio",
    }  # fmt: skip

    def __init__(self, site: str):
        self.site = site
        self.stubbed = set()

    def _engine_is_importing(self) -> bool:
        frame = sys._getframe(2)
        while frame is not None and (frame.f_code.co_filename.startswith("<frozen") or "importlib" in frame.f_code.co_filename):
            frame = frame.f_back
        return frame is not None and frame.f_code.co_filename.startswith(self.site)

    def find_spec(self, name, path, target=None):
        root = name.split(".")[0]
        if root not in self.allowed or ("." in name and root not in self.stubbed):
            return None  # a missing submodule of a real package stays missing
        if root not in self.stubbed and not self._engine_is_importing():
            return None  # other libraries' optional imports keep failing as they expect
        self.stubbed.add(root)
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    aliases = {"dill": "pickle"}  # dill pickles classes by reference just as pickle does

    def create_module(self, spec):
        if spec.name in self.aliases:
            return importlib.import_module(self.aliases[spec.name])
        module = types.ModuleType(spec.name)
        module.__path__ = []

        def getattr_(attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _Stub

        module.__getattr__ = getattr_
        return module

    def exec_module(self, module):
        pass


# ----------------------------------------------------------------------------- wheels
def fetch_wheels(folder: str, vllm_version: str, sglang_version: str) -> dict[str, str]:
    wheels = {}
    for name, version in (("vllm", vllm_version), ("sglang", sglang_version)):
        found = sorted(glob.glob(os.path.join(folder, f"{name}-{version}-*.whl")))
        if not found:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", folder, f"{name}=={version}"], check=True
            )
            found = sorted(glob.glob(os.path.join(folder, f"{name}-{version}-*.whl")))
        wheels[name] = found[0]
    return wheels


# Real (small) packages whose classes the engines subclass at import time: stubs would not do.
REAL_DEPS = ("msgspec",)


def install_real_deps(folder: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", folder, *REAL_DEPS], check=True
    )


def unpack_sources(wheel: str, site: str, root: str) -> None:
    with zipfile.ZipFile(wheel) as z:
        for member in z.namelist():
            if member.startswith(root + "/") and not member.endswith(".so"):
                z.extract(member, site)


def single_rank():
    """Tensor parallelism of one rank, wherever the engines' layers ask for it."""
    one = {"get_tensor_model_parallel_world_size": lambda *a, **k: 1, "get_tensor_model_parallel_rank": lambda *a, **k: 0}
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "") or ""
        if name.split(".")[0] in ENGINE_ROOTS:
            for attr, fn in one.items():
                if hasattr(module, attr):
                    setattr(module, attr, fn)
