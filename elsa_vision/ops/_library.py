"""The ``elsa_vision`` operator namespace: how the Triton paths become torch operators.

Each operator is declared once with ``torch.library``'s low-level API -- a schema (``define``), one kernel for
every device (``CompositeExplicitAutograd``: CUDA, and CPU under ``TRITON_INTERPRET=1``), a fake kernel for
shape propagation (``register_fake``) and, where it has one, its backward (``register_autograd``). That is
what ``torch.library.custom_op`` builds too, with the same guarantees: ``torch.compile(fullgraph=True)`` sees
one opaque node per call, ``torch.library.opcheck`` passes, autograd runs the registered backward.
What ``custom_op`` adds are Python wrappers around every call (argument defaults, a dynamo guard, output
aliasing checks), host time at every attention call that made half-precision models host-bound (measured in
``docs/kernel_notes.md``, "Host path").
"""

from __future__ import annotations

import torch

LIB = torch.library.Library("elsa_vision", "DEF")


def define_op(name: str, schema: str, impl, fake, backward=None, setup_context=None):
    """Declare ``elsa_vision::<name>`` with ``schema`` (``"(Tensor q, ...) -> (Tensor, Tensor)"``), its kernel
    ``impl``, its fake kernel ``fake`` and optionally its autograd formula; returns the operator packet
    (``torch.ops.elsa_vision.<name>``)."""
    qualname = f"elsa_vision::{name}"
    LIB.define(name + schema)
    LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(qualname, fake, lib=LIB)
    if backward is not None:
        torch.library.register_autograd(qualname, backward, setup_context=setup_context, lib=LIB)
    return getattr(torch.ops.elsa_vision, name)
