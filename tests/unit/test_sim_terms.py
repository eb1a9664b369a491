"""``simulate --details``: a step's cost by named term (``sim.terms``), adding up to the
prediction, each term the preset figure it names."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cpbench import strategies
from cpbench.cli import main as cli_main
from cpbench.config import AttentionConfig
from cpbench.errors import UsageError
from cpbench.sim import hardware, model, schedule, terms
from cpbench.topology import Topology

ATTN = AttentionConfig(batch=1, seqlen=65536, heads=64, kv_heads=8, head_dim=128,
                       dtype="bf16", causal=True)


def _predict(name: str, preset: str, world: int = 16, per_node: int = 8, hw=None):
    hw = hw or hardware.load(preset)
    return model.predict(name, strategies.get(name).Options(), ATTN,
                         Topology(world_size=world, ranks_per_node=per_node), hw)


@pytest.mark.parametrize("preset", ["a800-sxm", "h100-sxm", "b200"])
@pytest.mark.parametrize("name", ["ring", "zigzag", "ulysses", "llama3", "usp", "double-ring"])
def test_the_terms_add_up_to_the_prediction(name, preset):
    p = _predict(name, preset)
    assert [t for t, _, _ in p.terms] == list(terms.TERMS)
    assert sum(f for _, f, _ in p.terms) == pytest.approx(p.fwd_s, rel=1e-9)
    assert sum(b for _, _, b in p.terms) == pytest.approx(p.bwd_s, rel=1e-9)


def test_each_term_is_the_preset_figure_it_names():
    """Off, each term vanishes: no in-CP slowdown, no passes, no step cost; links at an
    unbounded rate and no latency leave no communication."""
    hw = hardware.load("h100-sxm")
    by = {t: (f, b) for t, f, b in _predict("zigzag", "", hw=hw).terms}
    assert by["NCCL contention"][0] > 0 and by["merge / rescale"][0] > 0
    assert by["launch / sync"][0] == pytest.approx(16 * hw.step_overhead_us * 1e-6)  # 16 steps
    free = dataclasses.replace(
        hw, kernel_in_cp=(1.0, 1.0), merge=hardware.Pass(), accumulate=hardware.Pass(),
        step_overhead_us=0.0, intra=hardware.Link(1e12, 0.0), inter=hardware.Link(1e12, 0.0),
        node_inter_gbs=1e12)
    off = {t: f + b for t, f, b in _predict("zigzag", "", hw=free).terms}
    for term in ("NCCL contention", "merge / rescale", "launch / sync", "comm latency"):
        assert off[term] == 0, term
    assert off["comm bandwidth"] == pytest.approx(0, abs=1e-9)
    assert off["kernel"] == pytest.approx(sum(by["kernel"]))


def test_details_prints_every_term_per_case(capsys):
    assert cli_main(["simulate", "--hardware", "h100-sxm", "--nodes", "1", "--seqlen", "64K",
                     "--heads", "64", "--kv-heads", "8", "--strategy", "zigzag,ulysses",
                     "--details"]) == 0
    out = capsys.readouterr().out.split("by term")[1]
    for term in (*terms.TERMS, "FWD+BWD"):
        assert f" {term} " in out, term
    header = next(x for x in out.splitlines() if "Term" in x)
    assert "zigzag" in header and "ulysses" in header


def test_nccl_contention_only_in_steps_whose_messages_overlap_the_kernel():
    """NCCL's kernels take SMs from attention only while they run beside it: a step whose
    messages overlap its kernel (a ring's P2P) pays ``kernel.in_cp``; one whose messages are
    exposed (Ulysses' all-to-alls, before and after the kernel) does not."""
    hw = hardware.load("h100-sxm")
    assert max(hw.kernel_in_cp) < 1
    s = terms.Scale(linear=1.0, square=1.0, length=1.0, share_side=8192.0)
    exposed = schedule.RankStep(flops=4e12, side=8192.0, intra_exp=1e8)
    for phase, in_cp in zip(("fwd", "bwd"), hw.kernel_in_cp):
        for ov in ({"intra_ov": 1e8}, {"inter_ov": 1e8}):
            overlapped = dataclasses.replace(exposed, **ov)
            quiet = terms.step(hw, schedule.StepLoad(phase, (exposed,), ((1,),)), 128, s)[2]
            busy = terms.step(hw, schedule.StepLoad(phase, (overlapped,), ((1,),)), 128, s)[2]
            assert quiet["NCCL contention"] == 0
            at_side = busy["kernel"] + busy["block size"]
            assert busy["NCCL contention"] == pytest.approx(at_side * (1 / in_cp - 1))
    # whole strategies on one node: Ulysses' prediction does not move with the in-CP rate,
    # a zigzag ring's does
    alone = dataclasses.replace(hw, kernel_in_cp=(1.0, 1.0))
    for name in ("ulysses", "zigzag"):
        p, q = _predict(name, "", world=8, hw=hw), _predict(name, "", world=8, hw=alone)
        nccl = {t: f + b for t, f, b in p.terms}["NCCL contention"]
        if name == "ulysses":
            assert nccl == 0 and p.fwd_s + p.bwd_s == pytest.approx(q.fwd_s + q.bwd_s)
        else:
            assert nccl > 0 and p.fwd_s + p.bwd_s > q.fwd_s + q.bwd_s


def test_a_gqa_backward_pays_its_kernels_own_dkv_sums_over_every_key_of_the_call():
    """FA3's GQA backward zeroes and converts fp32 dK / dV buffers over every key it is
    given (h100-sxm's ``gqa_sums``, 10 bytes a K or V element over HBM): a varlen backward
    step under GQA pays it on its K and V elements, by hand; not forward, not without GQA,
    not on a kernel that states none (fa2)."""
    import random

    hw = hardware.load("h100-sxm", kernel="fa3")
    s = terms.Scale(linear=1.0, square=1.0, length=1.0, share_side=8192.0)
    kv = random.uniform(1e7, 1e9)
    spectrum = ((128.0, 4096.0, False, 1.0),)
    step = schedule.RankStep(flops=1e12, side=4096.0, kv_elements=kv, v_elements=kv,
                             spectrum=spectrum, gqa=8)

    def merge(hw, phase, st):
        return terms.step(hw, schedule.StepLoad(phase, (st,), ((1,),)), 128, s)[2][
            "merge / rescale"]

    plain = merge(hw, "bwd", dataclasses.replace(step, gqa=1))
    assert merge(hw, "bwd", step) - plain == pytest.approx(
        2 * kv * 10 / hw.memory_bandwidth_gbs * 1e-9, rel=1e-9)
    assert merge(hw, "fwd", step) == merge(hw, "fwd", dataclasses.replace(step, gqa=1))
    fa2 = hardware.load("h100-sxm", kernel="fa2")
    assert merge(fa2, "bwd", step) == merge(fa2, "bwd", dataclasses.replace(step, gqa=1))


def test_a_varlen_call_is_priced_document_by_document():
    """Ulysses under packed documents, full mask: its one kernel call's time is each
    document's FLOPs at that document's length on the curve, summed (independently here),
    not the whole sequence's rate; and the spectrum's shares are the documents' areas
    (whole tiles of the default 128 x 128: ``sim.curves.Tiles``)."""
    from cpbench.kernels import masked_varlen
    from cpbench.mask import Mask
    from cpbench.sim.curves import Tiles

    docs = (512, 1024, 2048, 512, 1536)
    s = sum(docs)
    spec = masked_varlen.spectrum(masked_varlen.plan(Mask(False, docs), torch.arange(s),
                                                      torch.arange(s)))
    area = sum(d * d for d in docs)
    assert [(r, k, c) for r, k, c, _ in spec] == [(d, d, False) for d in sorted(set(docs))]
    assert [w for *_, w in spec] == pytest.approx(
        [docs.count(d) * d * d / area for d in sorted(set(docs))])
    hw = hardware.load("h100-sxm", kernel="fa3")
    attn = dataclasses.replace(ATTN, seqlen=s, causal=False, documents=docs)
    free = dataclasses.replace(
        hw, kernel_in_cp=(1.0, 1.0), merge=hardware.Pass(), accumulate=hardware.Pass(),
        step_overhead_us=0.0, intra=hardware.Link(1e12, 0.0), inter=hardware.Link(1e12, 0.0),
        node_inter_gbs=1e12, memory_bandwidth_gbs=None, tiles=(Tiles(), Tiles()))
    p = model.predict("ulysses", strategies.get("ulysses").Options(), attn,
                      Topology(world_size=8, ranks_per_node=8), free)
    per_head = 4 * 128 * ATTN.heads / 8  # FLOPs a pair, one GPU's heads
    for phase, got, mult in (("fwd", p.fwd_s, 1.0), ("bwd", p.bwd_s, 2.5)):
        curve = hw.kernel(phase, False, 128)
        want_s = sum(mult * per_head * d * d / (curve.tflops(d) * 1e12) for d in docs)
        assert got == pytest.approx(want_s, rel=1e-6)
        assert got > mult * per_head * area / (curve.tflops(s) * 1e12) * 1.05  # not the block's


def test_an_all_to_alls_layout_copies_are_priced_over_hbm():
    """Ulysses on 16 H100 (K/V heads 8 replicated to 16): the ``layout copies`` term is, by
    hand, each all-to-all's local tensor read and written twice into head shards (send
    buffer and the received chunks' cat) and once back to sequence shards (at batch 1 the
    send buffer is a view), over the datasheet HBM rate; ring strategies have none."""
    mib = 2 ** 20
    q = 4096 * 64 * 128 * 2 / mib  # a rank's q (and out, dout, dq): 64 MiB
    kv = 4096 * 16 * 128 * 2 / mib  # its replicated k (and v, dk, dv): 16 MiB
    fwd = 4 * (q + 2 * kv) + 2 * q  # q, k, v in; out back
    bwd = 4 * q + 2 * (q + 2 * kv)  # dout in; dq, dk, dv back
    p = _predict("ulysses", "h100-sxm")
    copies = {t: (f, b) for t, f, b in p.terms}["layout copies"]
    hbm = hardware.load("h100-sxm").memory_bandwidth_gbs * 1e9
    assert copies == pytest.approx((fwd * mib / hbm, bwd * mib / hbm), rel=1e-9)
    assert {t: (f, b) for t, f, b in _predict("zigzag", "h100-sxm").terms}[
        "layout copies"] == (0.0, 0.0)


def test_a_varlen_sequence_is_priced_as_its_whole_tiles():
    """Documents shorter than a tile, or not whole tiles: each costs its rows and keys
    rounded up to the kernel's tiles (default 128 x 128), at the length its tiles loop
    over, by hand on a random packing; a call of 13-token documents runs (128 / 13)^2
    slower than one-step tiles; FA3's own tiles (h100-sxm's ``tiles:``): its forward
    packs GQA 8:1's query heads into a tile's rows (13 x 8 = 104 of 128: 16 rows a head)
    by 176 keys, looping once over them, its backward 80 x 128, looping once over 80 rows."""
    import random

    from cpbench.kernels import masked_varlen
    from cpbench.mask import Mask
    from cpbench.sim.curves import piece_rate

    rng = random.Random()
    docs = tuple(rng.randrange(1, 700) for _ in range(40))
    s = sum(docs)
    spec = masked_varlen.spectrum(masked_varlen.plan(Mask(False, docs), torch.arange(s),
                                                      torch.arange(s)))
    hw = hardware.load("h100-sxm", kernel="fa3")
    curve = hw.kernel("fwd", False, 128)
    total = sum(d * d for d in docs)
    tile = [-(-d // 128) * 128 for d in docs]
    want = total / sum(t * t / curve.looping(t, 128) for t in tile)
    assert piece_rate(spec, lambda c: curve) == pytest.approx(want, rel=1e-9), docs
    tiny = masked_varlen.spectrum(masked_varlen.plan(Mask(False, (13,) * 10),
                                                      torch.arange(130), torch.arange(130)))
    assert piece_rate(tiny, lambda c: curve) == pytest.approx(
        curve.looping(128, 128) * (13 / 128) ** 2)
    fwd, bwd = hw.tiles
    assert piece_rate(tiny, lambda c: curve, fwd, 8) == pytest.approx(
        curve.looping(176, 176) * 13 * 13 / (16 * 176))
    assert piece_rate(tiny, lambda c: curve, bwd, 8, phase="bwd") == pytest.approx(
        curve.looping(80, 80) * 13 * 13 / (80 * 128))


def test_a_causal_piece_wider_than_tall_is_a_full_block_beside_its_diagonal():
    """A zigzag chunk's queries against every key of its document before them (bottom-right
    causal, r rows by a + r keys, drawn afresh): its r x a block left of the diagonal is
    priced on the full curve, its r x r diagonal on the causal one, both at the a + r keys
    the tiles loop over, by hand; faster than the whole piece on the causal curve."""
    import random

    from cpbench.kernels import masked_varlen
    from cpbench.mask import Mask
    from cpbench.sim.curves import piece_rate

    rng = random.Random()
    r, a = 128 * rng.randrange(1, 8), 128 * rng.randrange(1, 64)
    spec = masked_varlen.spectrum(masked_varlen.plan(Mask(True, (a + r,)),
                                                      torch.arange(a, a + r), torch.arange(a + r)))
    assert [s[:3] for s in spec] == [(r, a + r, True)], spec
    hw = hardware.load("h100-sxm", kernel="fa3")
    full_c, diag_c = hw.kernel("fwd", False, 128), hw.kernel("fwd", True, 128)
    full = r * a / (r * a + r * r / 2)
    want = 1 / (full / full_c.looping(a + r, 128) + (1 - full) / diag_c.looping(a + r, 128))
    got = piece_rate(spec, lambda c: diag_c if c else full_c)
    assert got == pytest.approx(want, rel=1e-9), (r, a)
    assert got > diag_c.looping(a + r, 128), (r, a)


def test_below_its_first_point_a_curve_pays_each_tiles_fixed_cost():
    """A curve measured as a benchmark of a fixed count of tiles, each looping n = L / 176
    steps in t0 + n tb (t0 = 1.5 tb, drawn afresh: any): the curve's two ends give t0 / tb
    back, and below its first point the rate is the tile model's, not the first point's."""
    import random

    from cpbench.sim.curves import KernelCurve

    c, top, step = random.uniform(0.2, 5.0), random.uniform(200, 900), 176

    def model(n):  # TFLOP/s: the tiles' work over their time
        return top * n / (c + n)

    curve = KernelCurve(tuple((n * step, model(n)) for n in (3, 6, 12, 24, 48, 96)))
    assert curve.fixed_steps(step) == pytest.approx(c, rel=1e-9)
    assert curve.looping(step, step) == pytest.approx(model(1), rel=1e-9)
    assert curve.looping(2 * step, step) == pytest.approx(model(2), rel=1e-9)
    assert curve.looping(2 * step, step) < curve.tflops(2 * step)  # the old rule: flat
    assert curve.looping(6 * step, step) == curve.tflops(6 * step)  # on the curve: its own
    # a flat curve has no fixed cost to read
    assert KernelCurve(((512.0, 300.0), (4096.0, 300.0))).fixed_steps(128) == 0.0


def test_a_curve_benchmarked_at_a_fixed_batch_holds_its_first_point_below_it():
    """cuDNN and FA4 on B200 / GB200 were benchmarked at a fixed batch (1 or 2, L growing):
    their rise with L is the call's own, not a tile's (``fixed_tile_count: false``), so a
    piece below the first point runs at that point's rate on its whole tiles; FA3 on H100
    (batch x L constant) keeps the tile model there; a flag not true / false is refused."""
    import yaml

    from cpbench.sim.curves import piece_rate

    hw = hardware.load("b200", kernel="cudnn")
    assert not hw.fixed_tile_count and hardware.load("h100-sxm", kernel="fa3").fixed_tile_count
    curve = hw.kernel("fwd", False, 128)
    spec = ((256.0, 256.0, False, 1.0),)  # 2 x 2 default tiles, below the first point (1k)
    held = piece_rate(spec, lambda c: curve, fixed_tiles=False)
    assert held == pytest.approx(curve.points[0][1], rel=1e-9)
    assert piece_rate(spec, lambda c: curve) < held  # the tile model reads the rise per tile
    with open(hardware.PRESET_DIR / "b200.yaml") as f:
        raw = yaml.safe_load(f)
    raw["kernels"]["cudnn"]["fixed_tile_count"] = "no"
    with pytest.raises(UsageError, match="fixed_tile_count must be true or false"):
        hardware.from_dict(raw, kernel="cudnn")


@pytest.mark.parametrize("tiles,match", [
    ({"fwd": {"rows": 64}}, "source: a name of its sources"),
    ({"source": "s", "fwd": {"rowz": 64}}, "give rows, keys"),
    ({"source": "s", "bwd": {"keys": 0}}, "positive integers")])
def test_a_preset_states_whole_tiles_with_a_source_or_is_refused(tiles, match):
    from cpbench.sim.curves import Tiles, parse_tiles

    assert parse_tiles({}, "p") == (Tiles(), Tiles())  # none stated: 128 x 128
    with pytest.raises(UsageError, match=match):
        parse_tiles({"tiles": tiles, "sources": {"s": "read in its source"}}, "p")
