"""benchmarks/ceiling.py: free_attention() removes every attention a model makes, and restores it after."""

import torch
import torch.nn.functional as F

from benchmarks.ceiling import free_attention
from elsa_vision import elsa_attention
from elsa_vision.layers import ElsaAttention
from elsa_vision.layers import attention as attention_layer
from elsa_vision.layers import window_attention as window_module  # where the Swin layers look the op up
from tests.helpers import qkv


def test_self_attention_returns_v_and_is_restored():
    q, k, v = qkv(2, 3, 7, 7, 8, dtype=torch.float64, device="cpu")
    def current():
        return F.scaled_dot_product_attention, attention_layer.elsa_attention, window_module.window_attention

    real = current()
    with free_attention():
        assert F.scaled_dot_product_attention(q, k, v) is v
        assert attention_layer.elsa_attention(q, k, v, backend="torch") is v
        out = window_module.window_attention(q, k, v, torch.zeros(3), torch.zeros(3, 7, 7))
        assert out.shape == v.shape and out.transpose(1, 2).is_contiguous()
    assert current() == real
    ref = elsa_attention(q, k, v, backend="torch")
    assert not torch.allclose(ref, v)
    torch.testing.assert_close(attention_layer.elsa_attention(q, k, v, backend="torch"), ref, rtol=0, atol=0)


def test_cross_attention_of_other_shapes_stays_real():
    q, k, v = qkv(2, 3, 3, 9, 8, dtype=torch.float64, device="cpu")
    with free_attention():
        got = attention_layer.elsa_attention(q, k, v, backend="torch")
    torch.testing.assert_close(got, elsa_attention(q, k, v, backend="torch"), rtol=0, atol=0)


def test_restored_after_an_exception():
    sdpa = F.scaled_dot_product_attention
    try:
        with free_attention():
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert F.scaled_dot_product_attention is sdpa


def test_layer_output_is_the_projection_of_v():
    torch.manual_seed(0)
    layer = ElsaAttention(16, num_heads=2, backend="torch").eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad(), free_attention():
        got = layer(x)
        v = layer.qkv(x).reshape(2, 5, 3, 2, 8)[:, :, 2].reshape(2, 5, 16)
        torch.testing.assert_close(got, layer.proj(v))
    with torch.no_grad():
        assert not torch.allclose(layer(x), got, atol=1e-3)  # with the real attention back


def test_planned_inference_path_is_freed_too():
    """The Triton backend's planned inference path (a launch program the layer keeps after its first eval
    call; on a GPU, or interpreted on CPU) is replaced as well, and is back afterwards."""
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    layer = ElsaAttention(32, num_heads=2, backend="triton").eval().to(dev)
    x = torch.randn(1, 5, 32, device=dev)
    with torch.no_grad():
        real = layer(x)  # plans the call
        assert layer.__dict__.get("_elsa_calls")
        with free_attention():
            got = layer(x)
        v = layer.qkv(x).reshape(1, 5, 3, 2, 16)[:, :, 2].reshape(1, 5, 32)
        torch.testing.assert_close(got, layer.proj(v))
        torch.testing.assert_close(layer(x), real, rtol=0, atol=0)
