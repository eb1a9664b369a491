"""A backward pass without the autograd engine, for fake CUDA tensors.

Without a GPU, torch's autograd engine cannot run a backward over fake CUDA tensors: it asks
the CUDA driver for the device's primary context ("hasPrimaryContext expects a valid device
index"). The graph itself is fine, and each of its nodes can be called directly: an
autograd Function's node (``BackwardCFunction``) through ``apply``, which runs the Function's
own ``backward(ctx, ...)``, and a built-in op's node (``TransposeBackward0``, …) by calling it.
``backward`` walks the graph from ``out`` as the engine does on one device: a node runs once
every consumer has handed it its gradient, the most recent node first (highest sequence
number), None gradients of a Function's outputs materialised as zeros (the engine's default),
a Function's saved tensors dropped after its backward, and leaf gradients accumulated into
``.grad``. A Function's backward returns a value per forward argument, the graph has an edge
per tensor argument only: ``recording()`` notes which were tensors while the forward runs.
The dry run uses it on CUDA only; on CPU the real engine runs. A unit test holds it equal to
the engine on real CPU tensors, gradient for gradient.
"""

from __future__ import annotations

import contextlib
import heapq

import torch

_TENSOR_ARGS = "_cpbench_tensor_args"


@contextlib.contextmanager
def recording():
    """Within the block, each autograd Function's node notes which forward arguments were
    tensors (the edges of the graph), for ``backward``."""
    fn = torch.autograd.Function
    original = fn.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        # a classmethod (torch 2.13) or a C classmethod_descriptor (2.14): bind it to cls
        out = original.__get__(None, cls)(*args, **kwargs)
        outs = out if isinstance(out, tuple) else (out,)
        node = next((t.grad_fn for t in outs
                     if isinstance(t, torch.Tensor) and t.grad_fn is not None), None)
        if node is not None and hasattr(node, "_forward_cls"):
            setattr(node, _TENSOR_ARGS, tuple(isinstance(a, torch.Tensor) for a in args))
        return out

    fn.apply = classmethod(apply)
    try:
        yield
    finally:
        fn.apply = original


def _consumers(root) -> dict:
    """node → how many edges point at it from the graph below ``root``."""
    count: dict = {}
    seen, stack = {root}, [root]
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            count[nxt] = count.get(nxt, 0) + 1
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return count


def _zeros(meta) -> torch.Tensor:
    return torch.zeros(tuple(meta.shape), dtype=meta.dtype, device=meta.device)


def _call(node, grads: list):
    """Run one node on its output gradients; its input gradients, as a tuple."""
    if hasattr(node, "_forward_cls"):  # an autograd Function: its own backward(ctx, ...)
        grads = [g if g is not None else _zeros(m)
                 for g, m in zip(grads, node._input_metadata)]
        result = node.apply(*grads)
        node.maybe_clear_saved_tensors()
        result = result if isinstance(result, tuple) else (result,)
        tensors = getattr(node, _TENSOR_ARGS, None)
        if tensors is None and len(result) != len(node.next_functions):
            raise RuntimeError(f"backward: {node.name()} ran outside fakegrad.recording(): "
                               f"which of its arguments were tensors is unknown")
        return tuple(g for g, t in zip(result, tensors or [True] * len(result)) if t)
    else:
        result = node(*grads)
    return result if isinstance(result, tuple) else (result,)


def _accumulate(node, grad) -> None:
    leaf = node.variable
    leaf.grad = grad if leaf.grad is None else leaf.grad + grad


@torch.no_grad()  # as the engine runs a backward (no create_graph): no graph of the graph
def backward(out: torch.Tensor, grad: torch.Tensor) -> None:
    """``out.backward(grad)`` without the engine (see the module docstring)."""
    root = out.grad_fn
    if root is None:
        raise RuntimeError("backward: the output has no graph (does it require grad?)")
    pending = _consumers(root)
    buffers = {root: [grad] + [None] * (len(root._input_metadata) - 1)}
    ready = [(-root._sequence_nr(), id(root), root)]
    while ready:
        _, _, node = heapq.heappop(ready)
        grads = buffers.pop(node)
        if type(node).__name__ == "AccumulateGrad":
            if grads[0] is not None:
                _accumulate(node, grads[0])
            continue
        # a node no gradient reached passes None on, as the engine's undefined gradients
        results = _call(node, grads) if any(g is not None for g in grads) else \
            (None,) * len(node.next_functions)
        for (nxt, slot), g in zip(node.next_functions, results):
            if nxt is None:
                continue
            buf = buffers.setdefault(nxt, [None] * max(1, len(nxt._input_metadata)))
            if g is not None:
                buf[slot] = g if buf[slot] is None else buf[slot] + g
            pending[nxt] -= 1
            if pending[nxt] == 0:
                heapq.heappush(ready, (-nxt._sequence_nr(), id(nxt), nxt))
        del grads, results
