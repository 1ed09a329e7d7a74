"""``benchmarks/torch_bound.py``: the torch bound frees exactly the linear layers' backward."""

from __future__ import annotations

import copy

import pytest
import torch

from benchmarks.torch_bound import FreeBackwardLinear, free_linear_backward_


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(9)
        self.up = torch.nn.Linear(9, 13)
        self.down = torch.nn.Linear(13, 5, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(self.norm(x)))) + self.norm(x)[..., :5]


def test_free_linear_backward_zeroes_linear_gradients_only():
    torch.manual_seed(0)
    model = _Block()
    free = copy.deepcopy(model)
    assert free_linear_backward_(free) == 2
    assert isinstance(free.up, FreeBackwardLinear) and free.up.weight is not model.up.weight
    x = torch.randn(3, 4, 9, requires_grad=True)
    target = torch.randn(3, 4, 5)
    losses = {}
    for name, net in (("dense", model), ("free", free)):
        losses[name] = ((net(x) - target) ** 2).sum()
        losses[name].backward()
    torch.testing.assert_close(losses["free"], losses["dense"])  # the forward is untouched
    for layer in ("up", "down"):
        assert getattr(free, layer).weight.grad.abs().max() == 0
        assert getattr(model, layer).weight.grad.abs().max() > 0
    assert free.up.bias.grad.abs().max() == 0  # below `down`, whose dx is zero
    # The LayerNorm's gradient comes only through the path that skips the linear layers.
    norm_only = copy.deepcopy(model)
    out = norm_only.norm(x)[..., :5] + norm_only.down(torch.nn.functional.gelu(norm_only.up(norm_only.norm(x)))).detach()
    ((out - target) ** 2).sum().backward()
    torch.testing.assert_close(free.norm.weight.grad, norm_only.norm.weight.grad)


def test_free_linear_backward_keeps_the_bias_gradient():
    layer = torch.nn.Sequential(torch.nn.Linear(4, 3))
    free_linear_backward_(layer)
    dy = torch.randn(2, 5, 3)
    layer(torch.randn(2, 5, 4)).backward(dy)
    torch.testing.assert_close(layer[0].bias.grad, dy.sum((0, 1)))


def test_free_linear_backward_refuses_a_bare_linear():
    with pytest.raises(TypeError, match="`model`"):
        free_linear_backward_(torch.nn.Linear(2, 2))


def test_compiled_bound_keeps_its_zeros_a_run_time_value():
    # Constant zeros would let Inductor delete the backward between the linear layers (measured:
    # a compiled LLaMA bound backward of 3.65 ms); the traced backward must build them from dY.
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    backward_ops = []

    def record_backward(graph, example_inputs):
        backward_ops.extend(str(node.target) for node in graph.graph.nodes)
        return make_boxed_func(graph.forward)

    model = _Block()
    free_linear_backward_(model)
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward),
                                                          bw_compiler=record_backward))
    x = torch.randn(3, 4, 9, requires_grad=True)
    compiled(x).sum().backward()
    assert any("nan_to_num" in op for op in backward_ops), backward_ops
    assert model.up.weight.grad.abs().max() == 0 and model.down.weight.grad.abs().max() == 0

