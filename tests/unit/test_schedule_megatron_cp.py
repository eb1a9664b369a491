"""megatron-cp's declared schedule against hand-computed bytes and FLOPs, and its forward's
stream order against TransformerEngine's (no processes, no GPU)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from schedule_helpers import plan, step_bytes

from cpbench.config import AttentionConfig
from cpbench.strategies.base import BWD, FWD
from cpbench.strategies.megatron_cp import TileStreams, _bwd_src, _fwd_src, p2p_forward


def _plan(attn, world, rpn, rank, cp_lists=None):
    return plan("megatron-cp", world, rpn, rank, attn, cp_lists=cp_lists)


@pytest.mark.parametrize("b,seqlen,h,hk,d,dtype,elt,world", [
    (2, 96, 4, 2, 16, "bf16", 2, 4),
    (1, 256, 8, None, 64, "fp32", 4, 8),
    (2, 96, 4, 2, 16, "fp16", 2, 2),
])
def test_bytes(b, seqlen, h, hk, d, dtype, elt, world):
    attn = AttentionConfig(batch=b, seqlen=seqlen, heads=h, kv_heads=hk, head_dim=d,
                           dtype=dtype, causal=True)
    n, s = world, seqlen // world
    # K and V packed in one buffer in the activation dtype (TransformerEngine v2.18
    # context_parallel.py L1690; backward buffers (2, kv) in kv.dtype, L2397-2400)
    kv = 2 * b * s * (hk or h) * d * elt
    for rank in range(world):
        st = _plan(attn, world, 2, rank)
        # forward: N-1 hops of the packed K/V (L1705-1715)
        assert step_bytes(st, FWD) == [kv] * (n - 1) + [0]
        # backward: K/V only, then K/V + dK/dV (activation dtype, same size), then dK/dV only
        # (L2486-2493)
        assert step_bytes(st, BWD) == [kv] + [2 * kv] * (n - 2) + [kv]
        assert sum(step_bytes(st, BWD)) == (n - 1) * 2 * kv
        # one message per step at most, all hidden behind that step's tile
        assert all(len(s.messages) <= 1 and all(m.overlapped for m in s.messages)
                   for s in st.schedule())


def test_bytes_example():
    # b=2, s_local=24, hk=2, d=16, bf16: K+V = 2*(2*24*2*16*2) = 6144 bytes
    attn = AttentionConfig(batch=2, seqlen=96, heads=4, kv_heads=2, head_dim=16, dtype="bf16")
    st = _plan(attn, 4, 2, 2)
    assert sum(step_bytes(st, FWD)) == 3 * 6144
    assert sum(step_bytes(st, BWD)) == 6144 + 2 * 12288 + 6144


def test_crosses_nodes():
    attn = AttentionConfig(batch=1, seqlen=64, heads=4, head_dim=8, dtype="bf16")
    assert all(m.crosses_nodes for s in _plan(attn, 4, 2, 0).schedule() for m in s.messages)
    assert not any(m.crosses_nodes for s in _plan(attn, 4, 4, 0).schedule() for m in s.messages)
    # inside rings of a bigger job (as a hierarchical a2a+p2p strategy would run it)
    st = _plan(attn, 8, 4, 5, cp_lists=[[0, 4], [1, 5], [2, 6], [3, 7]])
    assert st.cp_size == 2 and st.cp_index(5) == 1
    assert all(m.crosses_nodes for s in st.schedule() for m in s.messages)
    st = _plan(attn, 8, 4, 5, cp_lists=[[0, 1, 2, 3], [4, 5, 6, 7]])
    assert not any(m.crosses_nodes for s in st.schedule() for m in s.messages)
    assert sum(step_bytes(st, FWD)) == 3 * 2 * (1 * 16 * 4 * 8 * 2)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_ring_directions(n):
    for me in range(n):
        # forward starts on the own (diagonal) block, backward ends on it, from the other side
        assert _fwd_src(me, 0, n) == me and _bwd_src(me, n - 1, n) == me
        assert _bwd_src(me, 0, n) == _fwd_src(me, n - 1, n)  # where the forward stopped
        for step in range(n - 1):
            # the next step's block is the neighbour's current one: previous rank in forward,
            # next rank in backward
            assert _fwd_src(me, step + 1, n) == _fwd_src((me - 1) % n, step, n)
            assert _bwd_src(me, step + 1, n) == _bwd_src((me + 1) % n, step, n)


# -- TE's two forward streams, without a GPU ------------------------------------------------------

def te_forward_streams(n):
    """TransformerEngine v2.18 context_parallel.py, AttnFuncWithCPAndKVP2P.forward's loop
    (L1698-1970) as (what, stream) in issue order: streams = [current, cp_stream] (L1678)."""
    streams, events = ("current", "cp"), []
    for i in range(n + 1):
        if i < n:
            s = streams[i % 2]
            events.append(("enter", s))  # L1700
            if i > 0:
                events.append(("wait", s))  # L1701-1703: the K/V posted at step i-1
            if i < n - 1:
                events.append(("post", s))  # L1705-1715
            events.append(("kernel", s))  # L1781-1905
        if i > 0:  # step i-1's lse correction
            s = streams[(i - 1) % 2]
            if i > 1:
                events.append(("wait_event", s))  # L1916-1917
            events.append(("enter", s))  # L1919
            if i < n:
                events.append(("record_event", s))  # L1967-1968
    return events + [("wait_stream", "current", "cp")]  # L1970


class _Log:
    """Stand-ins for CUDA streams, the ring and the kernel, recording what happens where."""

    def __init__(self):
        self.events, self.current = [], "current"

    def stream(self, name):
        log = self

        class Stream:
            def wait_event(self, _event):
                log.events.append(("wait_event", name))

            def record_event(self, _event):
                log.events.append(("record_event", name))

            def wait_stream(self, other):
                log.events.append(("wait_stream", name, other.name))

        s = Stream()
        s.name = name
        return s

    @contextlib.contextmanager
    def use(self, stream):
        before, self.current = self.current, stream.name
        self.events.append(("enter", stream.name))
        try:
            yield
        finally:
            self.current = before

    # the ring
    def send_recv(self, x):
        self.events.append(("post", self.current))
        return x.clone()

    def commit(self):
        pass

    def wait(self):
        self.events.append(("wait", self.current))


@pytest.mark.parametrize("n", [1, 2, 4, 5])
def test_forward_streams_are_tes(n):
    """What runs on which stream, in which order: TileStreams and the forward loop against
    TE's loop. The real streams (torch.cuda.Stream, Event) never ran here: no GPU."""
    log = _Log()
    attn = AttentionConfig(batch=1, seqlen=8 * n, heads=2, head_dim=8, dtype="fp32")
    st = _plan(attn, n, n, n - 1)
    kernel = st.kernel_call

    def traced_kernel(*args, **kw):
        log.events.append(("kernel", log.current))
        return kernel(*args, **kw)

    st.kernel_call = traced_kernel
    streams = TileStreams([log.stream("current"), log.stream("cp")], "event", use=log.use)
    q, k, v = (torch.randn(1, 8, 2, 8) for _ in range(3))
    out, lse, _ = p2p_forward(st, q, k, v, log, streams)
    assert log.events == te_forward_streams(n)
    assert out.shape == q.shape and lse.shape == (1, 2, 8)


def test_no_streams_on_cpu():
    streams = TileStreams.for_tensor(torch.zeros(1), owner=None)
    assert streams.streams == []
    with streams.on(1):  # every call a no-op
        streams.before_correction(1)
        streams.after_correction(0, 4)
        streams.join()


def test_activation_dtype_sum():
    """TE sums the rescaled outputs in the activation dtype (L139-165, L1980-2030): a bf16
    output stays bf16 through the sum; the lse stays fp32."""
    attn = AttentionConfig(batch=1, seqlen=16, heads=2, head_dim=8, dtype="bf16")
    st = _plan(attn, 2, 2, 1)
    q, k, v = (torch.randn(1, 8, 2, 8, dtype=torch.bfloat16) for _ in range(3))
    out, lse, kv_last = p2p_forward(st, q, k, v, _Log(), TileStreams())
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    # K and V flattened into one buffer (TE's packing, KVPack): both blocks' elements
    assert kv_last.dtype == torch.bfloat16 and kv_last.shape == (2 * 1 * 8 * 2 * 8,)
