"""Kernels for the learn-and-replay tests (a plain, a ``@triton.heuristics`` and a
``@triton.autotune`` kernel, one taking a jitted function as a constexpr, and one taking an
IntEnum member and a ``triton.language`` dtype, as vLLM's unified attention and fused MoE
do), and the stub that stands in for the GPU driver.

There is no GPU here: Triton compiles for an explicit CUDA target without one, and
:class:`FakeDriver` stands in for the GPU driver that cannot exist on this machine (its
target is an sm90 GPU; device and stream are 0). Nothing can be loaded or launched through
it: ``_init_handles`` and real launches are a GPU's business, so the tests check that
replay skips them under the stub, not that they succeed.

The tests allow this module through ``KWARM_ALLOW_MODULES=replay_kernels``.
"""
import enum

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget


class FakeDriver:
    """Stands in for the GPU driver that cannot exist on this machine."""

    def __init__(self, arch: int = 90):
        self.arch = arch

    def get_current_target(self):
        return GPUTarget("cuda", self.arch, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def is_active(self):
        return True


def install_fake_driver(arch: int = 90) -> None:
    from triton.runtime import driver

    driver.set_active(FakeDriver(arch))


@triton.jit
def copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


@triton.heuristics({"BLOCK": lambda args: 64 if args["n"] <= 64 else 256})
@triton.jit
def heuristic_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)


TUNE_CONFIGS = [triton.Config({"BLOCK": 64}, num_warps=2), triton.Config({"BLOCK": 128}, num_warps=4),
                triton.Config({"BLOCK": 256}, num_warps=8)]


@triton.autotune(configs=TUNE_CONFIGS, key=["n"])
@triton.jit
def tuned_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


@triton.jit
def relu(x):
    return tl.maximum(x, 0)


@triton.jit
def apply_kernel(x_ptr, y_ptr, n, FN: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, FN(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)


class Scale(enum.IntEnum):
    """Like vLLM's ``KVQuantMode``: an IntEnum member passed as a constexpr."""
    NONE = 0
    DOUBLE = 1


@triton.jit
def cast_kernel(x_ptr, y_ptr, n, SCALE: tl.constexpr, OUT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    if SCALE == 1:
        x = x * 2
    tl.store(y_ptr + offs, x.to(OUT), mask=offs < n)


@triton.jit
def pdl_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, launch_pdl: tl.constexpr):
    """Like vLLM's Mamba ``causal_conv1d`` kernels: a ``launch_pdl`` constexpr, passed by keyword,
    which Triton also reads as the compiler option of that name (not in :func:`launch_all`)."""
    if launch_pdl:
        tl.extra.cuda.gdc_wait()
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def launch_all():
    """The "production" launches of these kernels, compile-only (``warmup``/``warmup=True``:
    nothing can run without a GPU). Autotuned: one launch per tuning key through the
    autotuner, which finds its choice in ``Autotuner.cache`` (a GPU would benchmark here)."""
    import torch
    from triton.runtime.jit import MockTensor

    f16 = torch.float16
    for n in (1, 7, 1024):
        copy_kernel.warmup(f16, f16, n, BLOCK=128, grid=(1,))
    copy_kernel.warmup(f16, f16, 1024, BLOCK=128, num_warps=8, grid=(1,))
    for n in (32, 1000):
        heuristic_kernel.warmup(f16, f16, n, grid=(1,))
    for n in (64, 4096):
        tuned_kernel.run(MockTensor(f16), MockTensor(f16), n, grid=(1,), warmup=True)
    apply_kernel.warmup(f16, f16, 100, FN=relu, BLOCK=128, grid=(1,))
    cast_kernel.warmup(f16, f16, 100, SCALE=Scale.DOUBLE, OUT=tl.float16, BLOCK=128, grid=(1,))


def choose_autotune_configs():
    """Stand-in for autotuning's benchmark (it needs a GPU): compile every candidate the way
    the autotuner's benchmark does, then record a winner per tuning key in its cache."""
    import torch
    from triton.runtime.jit import MockTensor

    f16 = torch.float16
    for n, winner in ((64, 0), (4096, 2)):
        tuned_kernel.warmup(MockTensor(f16), MockTensor(f16), n, grid=(1,))
        tuned_kernel.cache[(n, "torch.float16", "torch.float16")] = TUNE_CONFIGS[winner]
