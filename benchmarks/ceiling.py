"""Free attention: how much faster a model could get if its attention cost nothing.

``free_attention()`` answers every attention call of a model with ``v`` while it is active:
``torch.nn.functional.scaled_dot_product_attention`` (timm, open_clip's ``nn.MultiheadAttention`` path and
the ``sdpa`` peers), ``elsa_attention`` as the ELSA layers call it, and the W-ELSA window op of the Swin
layers.
Everything else of the model -- projections, MLPs, norms, the layout copies around the attention -- runs
unchanged. A model timed under it gives the ceiling of a case: ``peer_ms / free_ms`` is the most any attention
kernel can speed that model up, so a goal above it cannot be met by the attention alone.

The outputs are meaningless (attention is replaced by its values); only the time is used.
"""

from __future__ import annotations

import contextlib
import importlib

import torch

# (module, attribute) pairs that a model looks up at call time.
_ELSA_CALLS = (
    ("elsa_vision.layers.attention", "elsa_attention"),
    ("elsa_vision.layers.multihead_attention", "elsa_attention"),
    ("elsa_vision.layers.attention_pool", "elsa_attention"),
    ("elsa_vision.layers.sdpa", "elsa_attention"),  # SDPA-routed timm modules, sdpa_override
    ("elsa_vision.layers.window_attention", "elsa_attention"),  # Swin windows off the Triton path
)
_WINDOW_CALL = ("elsa_vision.layers.window_attention", "window_attention")  # where the Swin layers look it up
# ElsaAttention's planned inference path (eval, no grad) runs a launch program it keeps per input signature,
# not elsa_attention: with ``eager_bypass`` always choosing the operator side it takes the elsa_attention call
# above instead.
_PLANNED_PATH = ("elsa_vision.layers.attention", "eager_bypass")


def _answer_with_v(real):
    def free(q, k, v, *args, **kwargs):
        if q.shape[-2] != k.shape[-2] or q.shape[-1] != v.shape[-1]:
            return real(q, k, v, *args, **kwargs)  # cross-attention with other shapes: keep it real
        return v

    return free


def _free_window(q, k, v, *args, **kwargs):
    # The W-ELSA op stores its output as [B*nW, N, H, Dv]: same layout, so the reshape after it stays free.
    return v.new_empty(v.shape[0], v.shape[2], v.shape[1], v.shape[3]).transpose(1, 2)


@contextlib.contextmanager
def free_attention():
    """Within the block every self-attention of the ELSA models, timm and open_clip returns ``v``."""
    targets = [(torch.nn.functional, "scaled_dot_product_attention")]
    targets += [(importlib.import_module(mod), name) for mod, name in _ELSA_CALLS]
    saved = [(obj, name, getattr(obj, name)) for obj, name in targets]
    replaced = [(importlib.import_module(_WINDOW_CALL[0]), _WINDOW_CALL[1], _free_window),
                (importlib.import_module(_PLANNED_PATH[0]), _PLANNED_PATH[1], lambda t, body, op: op)]
    saved += [(obj, name, getattr(obj, name)) for obj, name, _ in replaced]
    try:
        for obj, name, real in saved[: len(targets)]:
            setattr(obj, name, _answer_with_v(real))
        for obj, name, stand_in in replaced:
            setattr(obj, name, stand_in)
        yield
    finally:
        for obj, name, real in saved:
            setattr(obj, name, real)
