"""The CPU compatibility layer's part for ``megatron.training`` (Megatron-LM's loop, which the
``mlm`` backend drives): plumbing stand-ins only, each naming the call site it serves; the
megatron-core part is :mod:`harness.backends.megatron.compat`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from harness.backends.megatron import compat

# --- megatron.training (Megatron-LM's loop, the ``mlm`` backend): each stand-in names its call site ---

@contextlib.contextmanager
def _one_device():
    # initialize._initialize_distributed and initialize._set_random_seed gate
    # initialize_model_parallel and model_parallel_cuda_manual_seed on
    # torch.cuda.device_count() > 0; the CPU is that one device (set_device is a no-op on it).
    count, set_device = torch.cuda.device_count, torch.cuda.set_device
    torch.cuda.device_count, torch.cuda.set_device = (lambda: 1), (lambda device: None)
    try:
        yield
    finally:
        torch.cuda.device_count, torch.cuda.set_device = count, set_device


def on_one_device(fn):
    """``fn`` run with the CPU as CUDA's one device (see :func:`_one_device`)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _one_device():
            return fn(*args, **kwargs)

    return wrapper


HELPERS = "megatron.core.datasets.helpers_cpp"


def _import_dataset_helpers():
    # initialize._compile_dependencies runs `make` in megatron/core/datasets; the wheel ships
    # the built helpers_cpp extension and no Makefile: importing it is the check.
    import_dataset_helpers()
    dist.barrier()


def import_dataset_helpers() -> None:
    """megatron-core's dataset helpers, or, in a source tree, the wheel's build of the same source."""
    try:
        importlib.import_module(HELPERS)
    except ModuleNotFoundError:
        import megatron.core.datasets as datasets

        from harness.run.trees import installed_root

        wheel = (installed_root() or Path("/nonexistent")) / "megatron" / "core" / "datasets"
        module = wheel_build_of_same_source(Path(datasets.__file__).parent, wheel)
        sys.modules[HELPERS] = datasets.helpers_cpp = module
        compat.record_stand_in(f"{HELPERS}: the installed wheel's build of the same helpers.cpp")


def wheel_build_of_same_source(tree: Path, wheel: Path):
    """A source tree (a checkout, a revision) holds ``tree/helpers.cpp`` but not its build.
    Where that file is byte for byte the installed wheel's, the wheel's build is that source's
    build: the module loaded from it. Otherwise the tree must be built; the error says how."""
    built = sorted(wheel.glob("helpers_cpp*.so"))
    source, theirs = tree / "helpers.cpp", wheel / "helpers.cpp"
    if not (built and source.is_file() and theirs.is_file() and source.read_bytes() == theirs.read_bytes()):
        raise ModuleNotFoundError(
            f"{HELPERS} is not built in {tree} and its helpers.cpp is not the installed wheel's: "
            f"build it (make -C {tree})", name=HELPERS)
    spec = importlib.util.spec_from_file_location(HELPERS, built[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def layered(install_layer):
    """A backend's stand-ins laid over megatron-core's (the mlm and bridge layers):
    ``install_layer`` runs once per process, after megatron-core's (``compat.install``) and
    only where those are (no CUDA). The wrapper returns whether they are in force."""
    done = False

    @functools.wraps(install_layer)
    def install_once() -> bool:
        nonlocal done
        if not compat.install():
            return False
        if not done:
            install_layer()
            done = True
        return True

    return install_once


@layered
def install_training() -> None:
    """Install the stand-ins megatron.training needs on CPU (after megatron-core's); the
    wrapper returns False (and changes nothing) when CUDA is usable."""
    from megatron.training import arguments, initialize, training

    # arguments.validate_args -> utils.get_device_arch_version() (GTP's Blackwell checks):
    # answer Hopper (9), the architecture class the CPU runs stand in for.
    compat._replace(arguments, "get_device_arch_version", lambda: 9,
                    "mlm arguments.get_device_arch_version -> 9")
    # training.pretrain -> initialize_megatron() asserts CUDA unless allow_no_cuda.
    compat._replace(training, "initialize_megatron",
                    functools.partial(initialize.initialize_megatron, allow_no_cuda=True),
                    "mlm training.initialize_megatron(allow_no_cuda=True)")
    for attr in ("_initialize_distributed", "_set_random_seed"):
        compat._replace(initialize, attr, on_one_device(getattr(initialize, attr)),
                        f"mlm initialize.{attr} on one device")
    compat._replace(initialize, "_compile_dependencies", _import_dataset_helpers,
                    "mlm initialize._compile_dependencies: the wheel's built dataset helpers")
    # training.pretrain -> set_jit_fusion_options -> _warmup_jit_function torch.compiles the
    # fused kernels the CPU flags turn off, drawing torch.rand from the weights' generator.
    compat._replace(training, "set_jit_fusion_options", lambda tp_size=None: None,
                    "mlm training.set_jit_fusion_options")
