"""Packed documents and sliding windows without processes: parsing, sampling, the exact
attended area (FLOPs), the masked CPU kernel against the float64 reference, the load balance
each layout gives, and strategies that cannot take a mask being skipped with the reason."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cpbench import kernels, metrics, strategies
from cpbench.bench.plan import plan
from cpbench.config import AttentionConfig, RunConfig
from cpbench.errors import Skipped, UsageError
from cpbench.kernels import masked
from cpbench.mask import Mask, pad_documents, parse_documents, parse_window, resolve_documents
from cpbench.reference import reference_attention
from cpbench.topology import Topology


def test_parse_documents_and_window():
    assert parse_documents("4k,2k,1k,1k") == (4096, 2048, 1024, 1024)
    assert parse_documents("uniform:1k-2k") == "uniform:1k-2k"
    assert parse_window("1023,0") == (1023, 0)
    for bad in ("normal:1,2", "uniform:2k-1k", "lognormal:1k"):
        with pytest.raises(UsageError, match="--documents"):
            parse_documents(bad)
    with pytest.raises(UsageError, match="LEFT,RIGHT"):
        parse_window("1023")


def test_sampled_documents_fill_the_sequence_under_the_cap(tmp_path):
    docs = resolve_documents("lognormal:2k,1.0", 65536, seed=3, max_document=None)
    assert sum(docs) == 65536 and max(docs) <= 65536 // 4
    assert docs == resolve_documents("lognormal:2k,1.0", 65536, seed=3, max_document=None)
    assert docs != resolve_documents("lognormal:2k,1.0", 65536, seed=4, max_document=None)
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("300\n500\n")
    docs = resolve_documents(f"file:{lengths}", 4096, seed=0, max_document=400)
    assert set(docs[:-1]) <= {300, 400} and sum(docs) == 4096
    with pytest.raises(UsageError, match="sum to 3072, not --seqlen 4096"):
        resolve_documents((2048, 1024), 4096, 0, None)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("docs", [None, (5, 3, 8)])
@pytest.mark.parametrize("window", [None, (2, 0), (1, 3), (0, 0), (-1, 2)])
def test_attended_pairs_count_the_mask_exactly(causal, docs, window):
    mask, pos = Mask(causal, docs, window), torch.arange(16)
    by_matrix = int(mask.visible(pos, pos).sum())
    assert metrics.attended_pairs(seqlen=16, causal=causal, documents=docs,
                                  window=window) == by_matrix == mask.pairs(pos, pos)


def test_window_flops_are_the_window_area_and_plain_keeps_the_formula():
    shape = dict(batch=1, seqlen=8192, heads=8, head_dim=64, causal=True)
    window, how = metrics.problem_flops(**shape, window=(1023, 0))
    causal, plain = metrics.problem_flops(**shape)
    assert (how, plain) == ("exact pairs", "formula")
    assert causal == 4 * 8 * 64 * 8192 ** 2 / 2  # the seeds' S²/2
    assert window / causal == pytest.approx(0.2344, abs=1e-4)


@pytest.mark.parametrize("by_runs", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_kernel_matches_the_float64_reference(dtype, by_runs):
    """Documents and a window on queries and keys in a shuffled (zigzag-like) order: the
    tiles' out, lse and gradients against the float64 reference with the same mask."""
    gen = torch.Generator().manual_seed(0)
    s, h, hk, d = 96, 4, 2, 16
    q, dout = (torch.randn(1, s, h, d, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(1, s, hk, d, generator=gen).to(dtype) for _ in range(2))
    mask = Mask(True, (40, 8, 48), (20, 0))
    pos = torch.cat([torch.arange(48, 96), torch.arange(0, 48)])  # the local order
    # by runs of positions, rows are in several tiles (merged by lse); else row tiles only
    tiles = masked.plan(mask.visible(pos, pos), *((pos, pos) if by_runs else ()))
    assert by_runs or len({int(r) for t in tiles for r in t.rows}) == sum(len(t.rows)
                                                                          for t in tiles)
    backend = kernels.get("sdpa-cpu")
    out, lse = masked.forward(backend, tiles, q, k, v, softmax_scale=d ** -0.5)
    grads = masked.backward(backend, tiles, dout, q, k, v, out.to(dtype), lse,
                            softmax_scale=d ** -0.5)
    ref = reference_attention(q[:, pos.argsort()], k[:, pos.argsort()], v[:, pos.argsort()],
                              dout[:, pos.argsort()], causal=True, softmax_scale=d ** -0.5,
                              visible=mask.visible(torch.arange(s), torch.arange(s)))
    tol = 2e-4 if dtype == torch.float32 else 6e-2
    got = {"out": out, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
    for name, t in got.items():
        assert torch.allclose(t[:, pos.argsort()].double(), ref[name], atol=tol, rtol=tol), name
    assert torch.allclose(lse[..., pos.argsort()].double(), ref["lse"], atol=tol)


def test_an_empty_block_is_no_tile():
    mask = Mask(True, (64, 64), None)
    assert masked.plan(mask.visible(torch.arange(64, 128), torch.arange(0, 64))) == []
    assert masked.plan(mask.visible(torch.arange(0, 32), torch.arange(32, 64))) == []


def _balance(name, attn, world=4, **opts):
    cls = strategies.get(name)
    topo = Topology(world_size=world, ranks_per_node=2)
    return cls(attn, topo, 0, kernel=kernels.get("sdpa-cpu"), options=cls.Options(**opts),
               create_groups=False).balance()


def test_imbalance_of_each_layout_on_documents():
    attn = AttentionConfig(seqlen=8192, documents=(4096, 2048, 1024, 1024))
    ring, zigzag = _balance("ring", attn), _balance("zigzag", attn)
    assert ring["imbalance"] == pytest.approx(2.18, abs=0.01)  # the acceptance's figure
    assert zigzag["imbalance"] == pytest.approx(1.0, abs=0.01)  # each document balanced
    assert _balance("ulysses", attn)["imbalance"] == 1.0  # heads split: the mask never is
    total = metrics.attended_pairs(seqlen=8192, causal=True, documents=attn.documents)
    for b in (ring, zigzag, _balance("llama3", attn)):
        assert sum(b["area_per_rank"]) == total
    # megatron-cp: zigzag's layout and forward ring; double-ring: the same blocks, its order
    assert _balance("megatron-cp", attn)["area_per_step"] == zigzag["area_per_step"]
    double = _balance("double-ring", attn)
    assert [sorted(s) for s in double["area_per_step"]] == \
        [sorted(s) for s in zigzag["area_per_step"]]
    assert [sum(s) for s in double["area_per_step"]] == zigzag["area_per_rank"]
    # per ring step: ring's rank 0 sees only its own block; everything later is empty
    assert ring["area_per_step"][0][1:] == [0, 0, 0]
    assert [sum(steps) for steps in ring["area_per_step"]] == ring["area_per_rank"]


def test_masked_schedules_declare_the_attended_area():
    attn = AttentionConfig(seqlen=1024, heads=8, head_dim=16, window_size=(127, 0))
    topo = Topology(world_size=4, ranks_per_node=2)
    want = metrics.problem_flops(batch=1, seqlen=1024, heads=8, head_dim=16, causal=True,
                                 window=(127, 0))[0]
    for name in ("ring", "zigzag", "ulysses", "llama3", "usp", "megatron-cp", "double-ring",
                 "megatron-cp-a2a+p2p"):
        cls = strategies.get(name)
        for opts in cls.variants(topo):
            total = sum(step.flops for r in range(4)
                        for step in cls(attn, topo, r, kernel=kernels.get("torch"),
                                        options=opts, create_groups=False).schedule()
                        if step.phase == "fwd")
            assert total == pytest.approx(want, rel=1e-9), (name, opts)


def test_a_strategy_that_cannot_take_the_mask_is_skipped_with_the_reason():
    run = RunConfig(strategy=("ring", "megatron-cp-a2a+p2p"), nproc=4, out="none")
    p = plan(run, {"seqlen": 1024, "documents": (512, 512)}, {}, launcher="self")
    assert [c.strategy for c in p.cases] == ["ring"]
    assert any("megatron-cp-a2a+p2p does not support --documents" in s for s in p.skipped)
    alone = RunConfig(strategy=("megatron-cp-a2a+p2p",), nproc=4, out="none")
    with pytest.raises(Skipped, match="does not support --documents"):
        plan(alone, {"seqlen": 1024, "documents": (512, 512)}, {}, launcher="self")


def test_zigzag_pads_documents_it_cannot_cut_or_refuses_them_on_request():
    run = RunConfig(strategy=("zigzag", "ring"), nproc=4, out="none")
    p = plan(run, {"seqlen": 1024, "documents": (500, 524)}, {}, launcher="self")
    assert [c.strategy for c in p.cases] == ["zigzag", "ring"]
    p = plan(run, {"seqlen": 1024, "documents": (500, 524),
                   "document_padding": "refuse"}, {}, launcher="self")
    assert [c.strategy for c in p.cases] == ["ring"]
    assert any("multiples of 8" in s and "drop --document-padding refuse" in s for s in p.skipped)


def test_pad_documents_pads_each_then_the_tail():
    assert pad_documents((500, 524), 1024, 8, 8) == ((504, 528), (4, 4))
    assert pad_documents((512, 512), 1024, 8, 8) == ((512, 512), (0, 0))
    # contiguous shards over 3 ranks: documents as they are, the sequence's tail padded
    assert pad_documents((500, 524), 1024, 1, 3) == ((500, 524, 2), (0, 0, 2))
    # usp 2x2 with a zigzag ring: documents to 4, the sequence to lcm(4, 4)
    layout, pads = pad_documents((3, 5, 9), 17, 4, 6)
    assert sum(layout) % 12 == 0 and all(d % 4 == 0 for d in layout)
    assert [d - p for d, p in zip(layout, pads) if d > p] == [3, 5, 9]


def test_pad_tokens_attend_to_nothing_and_nothing_attends_to_them():
    m = Mask(causal=True, documents=(4, 4, 2), padding=(1, 0, 2))
    every = torch.arange(10)
    vis = m.visible(every, every)
    pad = torch.tensor([3, 8, 9])
    assert not vis[pad].any() and not vis[:, pad].any()
    assert bool(vis[2, 0]) and bool(vis[2, 2]) and not bool(vis[4, 2])
    assert m.pairs(every, every) == int(vis.sum()) == 6 + 10
    # the FLOPs of the real problem: the real documents' pairs alone
    assert metrics.attended_pairs(seqlen=7, causal=True, documents=(3, 4)) == 6 + 10


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, (5, 0))])
def test_masked_kernel_matches_float64_with_pad_tokens_at_the_tail(causal, window):
    """A padded problem (a pad inside, a pad-only tail: TransformerEngine #3331's case) on
    fresh inputs: pad rows out 0 and lse -inf, no gradient into or out of them."""
    m = Mask(causal=causal, documents=(24, 16, 8), window=window, padding=(3, 0, 8))
    g = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, ())))
    q, k, v, do = (torch.randn(1, 48, 2, 16, generator=g) for _ in range(4))
    every = torch.arange(48)
    ref = reference_attention(q, k, v, do, causal=causal, softmax_scale=0.25,
                              visible=m.visible(every, every))
    block = masked.Block(m, every, every)
    out, lse = masked.forward(kernels.get("sdpa-cpu"), block.tiles, q, k, v,
                              softmax_scale=0.25)
    dq, dk, dv = masked.backward(kernels.get("sdpa-cpu"), block.tiles, do, q, k, v, out, lse,
                                 softmax_scale=0.25)
    pad = torch.tensor([21, 22, 23, *range(40, 48)])
    assert torch.isneginf(ref["lse"][..., pad]).all() and torch.isneginf(lse[..., pad]).all()
    real = torch.tensor([i for i in range(48) if i not in set(pad.tolist())])
    torch.testing.assert_close(lse[..., real].double(), ref["lse"][..., real], rtol=2e-4,
                               atol=2e-4)
    for got, want in ((out, ref["out"]), (dq, ref["dq"]), (dk, ref["dk"]), (dv, ref["dv"])):
        torch.testing.assert_close(got.double(), want, rtol=2e-3, atol=2e-4)
        assert not got[:, pad].any()


def test_report_best_names_a_winner_a_tie_or_unclear():
    from test_results import fake_record

    from cpbench.report.best import best_table, verdicts

    def rec(name, times, seqlen=1024):
        return fake_record(name, seqlen=seqlen, fwd_bwd=[times] * 4)

    ring = [30.0, 31.0, 30.5, 30.2, 30.8]
    records = [rec("ring", ring), rec("zigzag", [20.0, 20.5, 20.2, 20.1, 20.4]),
               rec("ring", ring, seqlen=2048),
               rec("zigzag", [29.0, 32.0, 30.0, 31.5, 30.1], seqlen=2048),
               rec("ring", [30.0, 30.05, 30.02, 30.03, 30.01], seqlen=4096),
               rec("zigzag", [30.0, 30.03, 30.04, 30.0, 30.02], seqlen=4096)]
    by_seqlen = {v.problem.split("S=")[1].split()[0]: v for v in verdicts(records)}
    win, unclear, tie = by_seqlen["1024"], by_seqlen["2048"], by_seqlen["4096"]
    assert (win.winner, win.runner_up, win.call) == ("zigzag", "ring", "wins")
    assert win.margin == pytest.approx(30.5 / 20.2 - 1)
    # overlapping intervals that reach outside 1 ± 2 %: no difference shown, nor its absence
    assert unclear.call == "unclear" and unclear.interval[1] > 1.02
    assert tie.call == "tie" and 0.98 <= tie.interval[0] and tie.interval[1] <= 1.02
    text = best_table(records)
    assert "wins" in text and "tie" in text and "unclear" in text
    # a wider band makes the unclear one a tie
    assert {v.call for v in verdicts(records, min_effect=0.2)} == {"wins", "tie"}


def test_sweep_protocols_and_mask_axes(tmp_path):
    from cpbench import sweep

    path = tmp_path / "s.yaml"
    path.write_text("""
base: {strategy: [ring, llama3], nproc: 2, heads: 2, head_dim: 16, warmup: 0, iters: 1,
       documents: "uniform:64-256"}
sweep: {tokens_per_rank: [512, 1k], window_size: ["-1,-1", "63,0"]}
cases: [{total_tokens: 2k, batch: 4, documents: [128, 384]}]
""")
    cfg = sweep.load(path)
    seqlens = [c.settings["seqlen"] for c in cfg.cases]
    assert seqlens == [1024, 1024, 2048, 2048, 512]  # 2 ranks × tokens; 2k / batch 4
    docs = cfg.cases[0].plan.attn.documents  # sampled once, with the run's seed
    assert sum(docs) == 1024 and max(docs) <= 256
    assert cfg.cases[0].plan.attn.window_size is None  # (-1, -1): no window
    assert cfg.cases[-1].plan.attn.documents == (128, 384)
    cmd = sweep.command(cfg, cfg.cases[1], "/tmp/o.jsonl")
    assert "--window-size" in cmd and "--documents" in cmd
    cmd = sweep.command(cfg, cfg.cases[0], "/tmp/o.jsonl")
    assert "--window-size=-1,-1" in cmd  # joined: "-1,-1" alone would read as a flag
    path.write_text("base: {nproc: 2, seqlen: 1k}\nsweep: {tokens_per_rank: [512]}\n")
    with pytest.raises(UsageError, match="each set the sequence length"):
        sweep.load(path)


def test_each_layout_declares_the_multiples_it_pads_to():
    topo = Topology(world_size=8, ranks_per_node=4)
    attn = AttentionConfig(seqlen=1000, heads=8, head_dim=16, documents=(301, 499, 200))

    def built(name, **opts):
        cls = strategies.get(name)
        return cls(attn, topo, 0, kernel=kernels.get("sdpa-cpu"), options=cls.Options(**opts),
                   create_groups=False)

    for name in ("zigzag", "megatron-cp", "double-ring"):
        st = built(name)
        assert st.pad_multiples() == (16, 16)
        assert all(d % 16 == 0 for d in st.attn.documents) and st.attn.seqlen == 1024
    for name in ("ring", "ulysses"):
        st = built(name)
        assert st.pad_multiples() == (1, 8) and st.attn.seqlen == 1000
    # llama3: any document length; zigzag cuts the whole sequence in 2N chunks (the tail pads)
    assert built("llama3", layout="contiguous").pad_multiples() == (1, 8)
    st = built("llama3", layout="zigzag")
    assert st.pad_multiples() == (1, 16) and st.attn.seqlen == 1008
    # zigzag-documents cuts every document in 2N, as TE's thd: each rank 2 chunks of each
    st = built("llama3", layout="zigzag-documents")
    assert st.pad_multiples() == (16, 16) and all(d % 16 == 0 for d in st.attn.documents)
    starts = [sum(st.attn.documents[:i]) for i in range(len(st.attn.documents))]
    for r in range(8):
        held = set(st.seq_index(r).tolist())
        for start, d in zip(starts, st.attn.documents):
            c = d // 16
            assert held >= set(range(start + r * c, start + (r + 1) * c))
            assert held >= set(range(start + (15 - r) * c, start + (16 - r) * c))
        assert len(held) == st.attn.seqlen // 8
    # usp 2 x 4 on a zigzag ring: documents to 8, the sequence to lcm(8, 8)
    st = built("usp", ulysses_degree=2)
    assert st.pad_multiples() == (8, 8) and st.ring.attn.documents == st.attn.documents
    assert st.padding()["padded_tokens"] == st.attn.seqlen - 1000
    assert built("usp", ulysses_degree=8).pad_multiples() == (1, 8)


def test_llama3_attends_each_document_as_one_run_of_the_gathered_keys():
    """The gathered K/V are put back in sequence order under a mask too (TE, MagiAttention's
    Ring AllGather), so a rank's varlen call sees each document's keys as one run: one piece
    per (query run, document); in member order a zigzagged document's keys came in 2N runs."""
    topo = Topology(world_size=4, ranks_per_node=4)
    attn = AttentionConfig(seqlen=1024, heads=4, head_dim=16, documents=(512, 256, 128, 128))
    for layout, runs in (("zigzag-documents", 2 * 4), ("zigzag", 2)):
        cls = strategies.get("llama3")
        for rank in range(4):
            st = cls(attn, topo, rank, kernel=kernels.get("sdpa-cpu"),
                     options=cls.Options(layout=layout))
            for half in (0, 1):  # one call per zigzag half (TE, MagiAttention)
                blk = st.gathered_tiles(half)
                assert torch.equal(blk.k_pos, torch.arange(1024))
                pieces = [(int(q0), int(k0)) for g in blk.varlen.groups
                          for q0, k0 in zip(g.q0, g.k0)]
                q_runs = len({q0 for q0, _ in pieces})
                assert len(pieces) == q_runs <= runs // 2, (layout, rank, half, pieces)


def test_llama3_calls_each_zigzag_half_apart_under_a_mask():
    """Under documents each half's queries are chunk r (then 2N-1-r) of every document, the
    halves split the local rows, and their calls see together what the rank's queries see."""
    topo = Topology(world_size=4, ranks_per_node=4)
    docs = (512, 256, 128, 128)
    attn = AttentionConfig(seqlen=1024, heads=4, head_dim=16, documents=docs)
    cls = strategies.get("llama3")
    starts = torch.tensor([0, 512, 768, 896])
    for rank in range(4):
        st = cls(attn, topo, rank, kernel=kernels.get("sdpa-cpu"),
                 options=cls.Options(layout="zigzag-documents"))
        rows = st.half_rows()
        assert sorted(np.concatenate(rows)) == list(range(st.local_seqlen))
        for half, chunk in enumerate((rank, 2 * 4 - 1 - rank)):
            pos = st.held_positions(rows[half])
            doc = torch.searchsorted(starts, pos, right=True) - 1
            size = torch.tensor(docs)[doc] // 8
            assert torch.equal((pos - starts[doc]) // size, torch.full_like(pos, chunk))
        whole = st.tiles("whole", st.seq_index(rank), torch.arange(1024))
        assert st.gathered_tiles(0).pairs + st.gathered_tiles(1).pairs == whole.pairs
    contiguous = cls(attn, topo, 1, kernel=kernels.get("sdpa-cpu"),
                     options=cls.Options(layout="contiguous"))
    assert contiguous.half_rows() == [slice(0, 256)]


def test_an_adapter_refuses_lengths_its_library_would_need_padded():
    topo = Topology(world_size=2, ranks_per_node=1)
    cls = strategies.get("rfa-zigzag")
    odd = AttentionConfig(seqlen=64, heads=4, head_dim=16, dtype="bf16", documents=(23, 9, 32))
    with pytest.raises(Skipped, match="multiple of 4.*refused, not padded"):
        cls(odd, topo, 0, kernel=kernels.get("sdpa-cpu"), create_groups=False)
    even = AttentionConfig(seqlen=64, heads=4, head_dim=16, dtype="bf16", documents=(24, 8, 32))
    assert cls(even, topo, 0, kernel=kernels.get("sdpa-cpu"), create_groups=False).attn is even


def test_the_default_padding_leaves_record_keys_as_before():
    assert "document_padding" not in AttentionConfig().to_dict()
    refuse = AttentionConfig(document_padding="refuse")
    assert refuse.to_dict()["document_padding"] == "refuse"
    assert AttentionConfig(**refuse.to_dict()) == refuse
    with pytest.raises(UsageError, match="--document-padding 'trim'"):
        AttentionConfig(document_padding="trim")
