"""The CPU compatibility layer's part for Megatron-Bridge (the ``bridge`` backend): plumbing
stand-ins only, each naming the call site it serves; megatron-core's part is
:mod:`harness.backends.megatron.compat`. Applied only where CUDA is unusable, except the two
import stand-ins, which serve a module that imports a package unguarded that this machine
cannot install (Transformer Engine, the resiliency extension), and are seen by that module
alone: megatron-core asks ``try: import transformer_engine`` in about twenty places, and a
stand-in visible to those would pass for the real library.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import types

import torch

from harness.backends.megatron import compat
from harness.backends.mlm import compat as training_compat

# package -> the one module that may import a stand-in of it (its unguarded import site)
IMPORT_STAND_INS = {
    # peft/lora_layers.py l.20 `import transformer_engine.pytorch as te` (reached from
    # megatron/bridge/__init__.py); the names it reads at import are annotations (te.ops.*).
    "transformer_engine": "megatron.bridge.peft.lora_layers",
    # training/pretrain.py l.19 `from nvidia_resiliency_ext.inprocess import CallWrapper`, an
    # annotation of pretrain(); the registry's newest build (0.4.1) breaks `import megatron.core`.
    "nvidia_resiliency_ext": "megatron.bridge.training.pretrain",
}


class _Absent:
    """A class of the absent package: usable in annotations and isinstance, never built."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"{type(self).__qualname__}: a stand-in for a package this machine does not have")


def _stand_in(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []

    def attribute(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        value = type(attr, (_Absent,), {}) if attr[:1].isupper() else _stand_in(f"{name}.{attr}")
        setattr(module, attr, value)
        return value

    module.__getattr__ = attribute
    return module


class _OneImporter(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves :data:`IMPORT_STAND_INS` to their one importer; drops them from ``sys.modules`` at
    the next import made by any other module, so nothing else ever finds them there."""

    def __init__(self):
        self.made: dict[str, types.ModuleType] = {}

    @staticmethod
    def _importer() -> str | None:
        frame = sys._getframe(2)
        while frame is not None and frame.f_globals.get("__name__",
                                                        "").startswith(("importlib", "_frozen_importlib")):
            frame = frame.f_back
        return frame.f_globals.get("__name__") if frame is not None else None

    def find_spec(self, name, path=None, target=None):
        importer = self._importer()
        if IMPORT_STAND_INS.get(name.split(".")[0]) == importer:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        if importer not in IMPORT_STAND_INS.values():
            self.forget()
        return None

    def forget(self) -> None:
        for name, module in list(self.made.items()):
            if sys.modules.get(name) is module:
                del sys.modules[name]
            del self.made[name]

    def create_module(self, spec):
        module = self.made[spec.name] = _stand_in(spec.name)
        compat.record_stand_in(f"{spec.name}: seen by {IMPORT_STAND_INS[spec.name.split('.')[0]]} only")
        return module

    def exec_module(self, module):
        pass


_FINDER = _OneImporter()


def import_bridge():
    """``import megatron.bridge`` with the import stand-ins seen by their one importer each."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    try:
        import megatron.bridge
        import megatron.bridge.training.pretrain  # noqa: F401
    finally:
        sys.meta_path.remove(_FINDER)
        _FINDER.forget()
    return megatron.bridge


@training_compat.layered
def install() -> None:
    """Install the stand-ins Bridge's training needs on CPU (after megatron-core's); the
    wrapper returns False (and changes nothing) when CUDA is usable."""
    from megatron.bridge.training import initialize, setup

    # setup.py l.253: initialize_megatron(...) without allow_no_cuda; initialize.py l.91 asserts CUDA.
    compat._replace(setup, "initialize_megatron",
                    functools.partial(initialize.initialize_megatron, allow_no_cuda=True),
                    "bridge setup.initialize_megatron(allow_no_cuda=True)")
    # initialize.torch_dist_init and _set_random_seed gate initialize_model_parallel and
    # model_parallel_cuda_manual_seed on torch.cuda.device_count() > 0: the CPU is that one device.
    for attr in ("torch_dist_init", "_set_random_seed"):
        compat._replace(initialize, attr, training_compat.on_one_device(getattr(initialize, attr)),
                        f"bridge initialize.{attr} on one device")
    # initialize.py l.148: compile_helpers() runs `make` in megatron/core/datasets on local rank 0;
    # the wheel ships the built helpers_cpp and no Makefile (a source tree: the wheel's build of
    # the same helpers.cpp, as for the mlm backend), imported here on every rank.
    training_compat.import_dataset_helpers()
    compat._replace(initialize, "compile_helpers", lambda: None, "bridge initialize.compile_helpers")
    # setup.py l.309: set_jit_fusion_options -> _warmup_jit_function torch.compiles the fused
    # kernels the CPU configuration turns off, on a CUDA stream.
    compat._replace(setup, "set_jit_fusion_options", lambda *a, **k: None,
                    "bridge setup.set_jit_fusion_options")
    _accelerator_stream()


def _accelerator_stream() -> None:
    # megatron-core's optimizer asks torch.accelerator.current_stream() (no accelerator: an error).
    if torch.accelerator.current_accelerator() is None:
        compat._replace(torch.accelerator, "current_stream", lambda device=None: compat._CURRENT_STREAM,
                        "torch.accelerator.current_stream")
