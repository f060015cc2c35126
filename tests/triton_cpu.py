"""Run Triton kernels on CPU: import this before anything imports a kernel module.

Without CUDA, kernels run under Triton's interpreter (TRITON_INTERPRET=1 must be set before
the @triton.jit functions are defined). The interpreter of triton 3.6 turns a scalar loop
bound into an int with int(array), which numpy >= 2.4 refuses for 1-element arrays; the patch
below reads the element instead. Nothing changes when CUDA is present.
"""

from __future__ import annotations

import importlib.util
import os

import torch

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
KERNEL_DEVICE = "cuda" if HAS_CUDA else "cpu"

if HAS_TRITON and not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.runtime.interpreter as _interpreter

    _patch_lang_tensor = _interpreter._patch_lang_tensor

    def _patch_scalar_index(tensor, scope) -> None:
        _patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interpreter._patch_lang_tensor = _patch_scalar_index
