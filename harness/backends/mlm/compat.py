"""The CPU compatibility layer's part for ``megatron.training`` (Megatron-LM's loop, which the
``mlm`` backend drives): plumbing stand-ins only, each naming the call site it serves; the
megatron-core part is :mod:`harness.backends.megatron.compat`.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

from harness.backends.megatron import compat

# --- megatron.training (Megatron-LM's loop, the ``mlm`` backend): each stand-in names its call site ---

_training_installed = False


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


def _on_one_device(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _one_device():
            return fn(*args, **kwargs)

    return wrapper


def _import_dataset_helpers():
    # initialize._compile_dependencies runs `make` in megatron/core/datasets; the wheel ships
    # the built helpers_cpp extension and no Makefile: importing it is the check.
    import importlib

    importlib.import_module("megatron.core.datasets.helpers_cpp")
    dist.barrier()


def install_training() -> bool:
    """Install the stand-ins megatron.training needs on CPU (after :func:`install`).

    Returns False (and changes nothing) when CUDA is usable."""
    global _training_installed
    if not compat.install():
        return False
    if _training_installed:
        return True
    from megatron.training import arguments, initialize, training

    # arguments.validate_args -> utils.get_device_arch_version() (GTP's Blackwell checks):
    # answer Hopper (9), the architecture class the CPU runs stand in for.
    arguments.get_device_arch_version = lambda: 9
    # training.pretrain -> initialize_megatron() asserts CUDA unless allow_no_cuda.
    training.initialize_megatron = functools.partial(initialize.initialize_megatron, allow_no_cuda=True)
    initialize._initialize_distributed = _on_one_device(initialize._initialize_distributed)
    initialize._set_random_seed = _on_one_device(initialize._set_random_seed)
    initialize._compile_dependencies = _import_dataset_helpers
    # training.pretrain -> set_jit_fusion_options -> _warmup_jit_function torch.compiles the
    # fused kernels the CPU flags turn off, drawing torch.rand from the weights' generator.
    training.set_jit_fusion_options = lambda tp_size=None: None
    _training_installed = True
    return True
