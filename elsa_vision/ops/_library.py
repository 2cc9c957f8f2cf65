"""The ``elsa_vision`` operator namespace: how the Triton paths become torch operators.

Each operator is declared once with ``torch.library``'s low-level API -- a schema (``define``), one kernel for
every device (``CompositeExplicitAutograd``: CUDA, and CPU under ``TRITON_INTERPRET=1``), a fake kernel for
shape propagation (``register_fake``) and, where it has one, its backward (``register_autograd``). That is
what ``torch.library.custom_op`` builds too, with the same guarantees: ``torch.compile(fullgraph=True)`` sees
one opaque node per call, ``torch.library.opcheck`` passes, autograd runs the registered backward.
What ``custom_op`` adds are Python wrappers around every call (argument defaults, a dynamo guard, output
aliasing checks), host time at every attention call that made half-precision models host-bound (measured in
``docs/kernel_notes.md``, "Host path"). For the same reason a plain eager call skips the dispatcher
altogether (:func:`eager_bypass`).
"""

from __future__ import annotations

import torch
from torch import Tensor

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


def eager_bypass(t: Tensor, body, op):
    """What runs an operator call on ``t``: ``body`` (the operator's kernel, called directly, past the
    dispatcher) when the call is plain eager -- ``t`` is a plain tensor and nothing could intercept the call
    (no compilation or export tracing, no dispatch or torch-function mode, no functorch transform) --, else
    ``op``, the operator, so that everything that traces or transforms sees it. Call sites read
    ``eager_bypass(q, _attention_fwd, _ATTENTION_FWD)(q, k, v, ...)``.

    The test is written out here rather than in a helper of its own: this is every operator call's hot path,
    and one Python call less is host time saved at each of them (``docs/kernel_notes.md``, "Host path")."""
    return body if (type(t) is Tensor and not torch.compiler.is_compiling()
                    and torch._C._len_torch_dispatch_stack() == 0
                    and not torch._C._is_torch_function_mode_enabled()
                    and not torch._C._are_functorch_transforms_active()) else op
