"""Prepared GPU kernels: Triton sources, their ahead-of-time compilation and node lowering.

Owns the GPU side of Ignition. :mod:`ignition.kernels.compiler` compiles a Triton function into a
cubin for a named target without a GPU; :mod:`ignition.kernels.lowering` turns program nodes into
kernel launches; the other modules hold the kernels of each operator family and register their
lowering functions. Importing this package imports no Triton; compiling does.
"""

from __future__ import annotations

import importlib

KERNEL_MODULES = (
    "elementwise",
    "linear",
    "attention",
    "sampling",
    "speculative",
    "self_draft",
    "sampled_draft",
    "recurrence",
    "latent",
)
"""Modules whose import registers lowering functions."""


def load_kernel_modules() -> None:
    """Import every kernel module (registering its lowering functions)."""
    for name in KERNEL_MODULES:
        importlib.import_module(f"ignition.kernels.{name}")
