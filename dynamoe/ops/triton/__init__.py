"""Triton fast paths of the ops (GPU), each beside the plain reference it is tested against.

Modules, one concern each (import them lazily: importing one decorates its kernels):

* ``routing``      -- softmax-top-k and DeepSeek sigmoid/group-limited top-k, one launch each;
* ``permute``      -- sort assignments by expert (offsets, slots, capacity slots) and the
  weighted combine, no host synchronisation;
* ``grouped_gemm`` -- grouped matmul over the ragged layout (bf16/fp16/fp32, fp32 accumulate),
  optional row gather, bias, fused SwiGLU and row scale;
* ``quant_gemm``   -- the same over packed FP8-blockwise / MXFP4 / NVFP4 weights, dequantized
  tile by tile in registers.

Selection (``use_triton``): a tensor on CUDA, ``triton`` importable, and ``DYNAMOE_NO_TRITON`` unset
or "0". Everything else -- CPU tensors in particular -- runs the existing code, unchanged. The
kernels are forward-only: the wired ops also require that no autograd graph is being recorded.

Testing on CPU: Triton's interpreter runs these kernels on CPU tensors when the environment has
``TRITON_INTERPRET=1`` before ``triton`` is first imported (its own library functions are decorated
then), when a kernel module is imported (``triton.jit`` reads it when it decorates) and while
launching. tests/test_triton_kernels.py arranges all three (see its docstring). In the
interpreter ``tl.dot`` on bf16/fp16 tiles is wrong, so the launchers pass ``UPCAST=True`` (fp32
tiles into ``tl.dot``) whenever the kernel is an interpreted one. tests/triton_compile_check.py
compiles the kernels for sm_90 on CPU (no GPU), catching what the interpreter cannot.
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch
from torch import Tensor

__all__ = ["available", "disabled", "use_triton", "no_grad_needed", "interpreted", "next_pow2", "fix_interpreter",
           "ROUTING_MAX_EXPERTS", "FLOAT_DTYPES"]

ROUTING_MAX_EXPERTS = 1024  # the routing kernels hold a token's whole expert row in registers
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what the kernels take (fp64 stays on torch)


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """True when ``triton`` can be imported (checked once, on first use; nothing is imported at
    ``import dynamoe`` time)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # a broken install (e.g. a wheel for another CUDA) counts as missing
        return False
    return True


def disabled() -> bool:
    """``DYNAMOE_NO_TRITON`` set to anything but "" or "0" turns the Triton paths off (read on every call)."""
    return os.environ.get("DYNAMOE_NO_TRITON", "") not in ("", "0")


def use_triton(*tensors: Tensor | None) -> bool:
    """Whether the ops should take their Triton path for these tensors: all given tensors on CUDA,
    Triton importable, ``DYNAMOE_NO_TRITON`` not set. Always False for CPU tensors."""
    ts = [t for t in tensors if t is not None]
    if not ts or not all(t.is_cuda for t in ts) or disabled():
        return False
    return available()


def no_grad_needed(*tensors: Tensor | None) -> bool:
    """True when no autograd graph is recorded through these tensors (the kernels are forward-only)."""
    return not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in tensors)


def interpreted(kernel) -> bool:
    """True when ``kernel`` was decorated under TRITON_INTERPRET=1 (it then runs on CPU tensors)."""
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(kernel, InterpretedFunction)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


_FIXED = False


def fix_interpreter() -> None:
    """Work around triton-lang/triton#9171 under TRITON_INTERPRET=1: with numpy >= 2.4 the
    interpreter's ``int(tensor)`` (used by ``range()`` over a runtime bound) fails on its 1-element
    arrays. Kernel modules call this at import; it patches only when interpreting, once."""
    global _FIXED
    if _FIXED:
        return
    from triton import knobs
    if not knobs.runtime.interpret:
        return
    from triton.runtime import interpreter
    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_lang_tensor
    _FIXED = True
