"""Which compiled variants of our Triton kernels a piece of code launches, on CPU.

On a GPU, Triton compiles a kernel once per specialization key: the constexpr values, each
pointer's dtype and 16-byte alignment, each integer's divisibility by 16 (unless the kernel
says do_not_specialize), and the launch options (num_warps, num_stages). A key first met while
serving is a compile (~1 s) inside a request. Under Triton's interpreter nothing compiles, but
the key of every launch can still be computed the way Triton's own launcher does
(create_function_from_signature over the kernel's signature, triton 3.6): `KernelVariants`
hooks every @triton.jit kernel of llmserve.inference.kernels and records the keys it launches.
Import tests.triton_cpu first.
"""

from __future__ import annotations

import importlib
import pkgutil

from triton.backends.compiler import BaseBackend
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction, create_function_from_signature

import llmserve.inference.kernels as kernels_package

Variant = tuple[str, tuple, tuple]  # (kernel, specialization, launch options)
_SPECIALIZATION_OPTIONS = ("do_not_specialize", "do_not_specialize_on_alignment")


class KernelVariants:
    """Records the variant of every launch while entered; `take()` returns and forgets them."""

    def __init__(self):
        self._seen: set[Variant] = set()
        self._recording = False
        for kernel_name, kernel in _our_kernels():
            kernel.add_pre_run_hook(self._hook_for(kernel_name, kernel))

    def __enter__(self) -> "KernelVariants":
        self._recording = True
        return self

    def __exit__(self, *exc) -> None:
        self._recording = False

    def take(self) -> set[Variant]:
        seen, self._seen = self._seen, set()
        return seen

    def _hook_for(self, kernel_name: str, kernel: InterpretedFunction):
        jit = JITFunction(kernel.fn, **{k: v for k, v in kernel.kwargs.items() if k in _SPECIALIZATION_OPTIONS})
        binder = create_function_from_signature(jit.signature, jit.params, BaseBackend)
        parameters = jit.signature.parameters

        def record(*args, **kwargs) -> None:
            if not self._recording:
                return
            _, specialization, _ = binder(*args, **{k: v for k, v in kwargs.items() if k in parameters})
            options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in parameters))
            self._seen.add((kernel_name, tuple(map(tuple, specialization)), options))

        return record


def _our_kernels():
    for module_info in pkgutil.iter_modules(kernels_package.__path__):
        module = importlib.import_module(f"{kernels_package.__name__}.{module_info.name}")
        for name, value in vars(module).items():
            if isinstance(value, InterpretedFunction) and value.fn.__module__ == module.__name__:
                yield f"{module_info.name}.{name}", value
