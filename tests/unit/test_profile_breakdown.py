"""The step breakdown on hand-built traces: overlaps counted once by priority, exposed
communication, idle, step windows, which events count on GPU and on CPU; and the record's
``profile`` section with its detail lines."""

import pytest

from cpbench.bench import profiling
from cpbench.profile import breakdown as bd
from cpbench.profile import groups, summary
from cpbench.profile.parsers import Event, Trace

RULES = groups.load()
ATTN_FWD, ATTN_BWD = "flash_fwd_kernel<…>", "flash_bwd_dq_dk_dv_loop_kernel<…>"
NCCL, ADD, COPY = "ncclDevKernel_SendRecv(x)", "elementwise_kernel<CUDAFunctor_add>", "Memcpy DtoD"


def k(name, start, end, cat="kernel", tid=7):
    return Event(name, cat, float(start), float(end), 0, tid)


def step(start, end, name=bd.STEP_MARK, cat="user_annotation"):
    return Event(name, cat, float(start), float(end), 1, 1)


def test_overlap_is_counted_once_by_priority():
    # 0-100 step; attention 0-60 (stream 7); NCCL 20-90 (stream 9); add 50-70 (stream 8)
    b = bd.breakdown(Trace((step(0, 100), k(ATTN_FWD, 0, 60), k(NCCL, 20, 90, tid=9),
                            k(ADD, 50, 70, tid=8))), RULES)
    assert b.timeline == bd.GPU and b.steps == 1 and b.wall_us == 100
    # attention owns 0-60; the add 60-70 (over the transfer); NCCL alone 70-90; idle 90-100
    assert b.part_us == {"attention/fwd": 60, "elementwise": 10, "communication/send_recv": 20,
                         "idle": 10}
    d = b.to_dict()
    assert d["wall_pct"] == {"attention/fwd": 60.0, "elementwise": 10.0,
                             "communication/send_recv": 20.0, "idle": 10.0}
    assert d["busy_pct"] == pytest.approx({"attention/fwd": 66.667, "elementwise": 11.111,
                                           "communication/send_recv": 22.222}, abs=1e-3)
    assert d["exposed_comm_ms"] == 0.02 and d["exposed_comm_pct"] == 20.0
    assert d["step_ms"] == 0.1 and d["steps"] == 1


def test_hidden_communication_is_not_exposed():
    b = bd.breakdown(Trace((step(0, 100), k(ATTN_BWD, 0, 100), k(NCCL, 10, 90, tid=9))), RULES)
    assert b.part_us == {"attention/bwd": 100, "idle": 0}
    assert b.exposed_comm_us == 0


def test_same_part_overlapping_is_its_union():
    b = bd.breakdown(Trace((step(0, 100), k(ATTN_FWD, 0, 40), k(ATTN_FWD, 30, 50, tid=9),
                            k(COPY, 60, 70, cat="gpu_memcpy"))), RULES)
    assert b.part_us == {"attention/fwd": 50, "memory": 10, "idle": 40}


def test_steps_clip_and_exclude_what_is_outside():
    events = (step(0, 100), step(200, 300), k(ATTN_FWD, -50, 50), k(NCCL, 150, 250, tid=9),
              k(ADD, 120, 180))  # the add runs between the steps: in neither
    b = bd.breakdown(Trace(events), RULES)
    assert b.steps == 2 and b.wall_us == 200
    assert b.part_us == {"attention/fwd": 50, "communication/send_recv": 50, "idle": 100}
    d = b.to_dict()
    assert d["step_ms"] == 0.1 and d["exposed_comm_ms"] == 0.025
    assert sum(d["wall_pct"].values()) == pytest.approx(100)


def test_windows_fall_back_to_profiler_steps_then_the_whole_trace():
    gpu_step = step(10, 60, "ProfilerStep#3", "gpu_user_annotation")
    cpu_step = step(0, 50, "ProfilerStep#3")
    events = (cpu_step, gpu_step, k(ATTN_FWD, 10, 60))
    assert bd.step_windows(Trace(events), device=True) == [(10, 60)]
    assert bd.step_windows(Trace(events), device=False) == [(0, 50)]
    b = bd.breakdown(Trace((k(ATTN_FWD, 5, 20), k(NCCL, 30, 45, tid=9))), RULES)
    assert b.steps == 1 and b.wall_us == 40
    assert b.part_us == {"attention/fwd": 15, "communication/send_recv": 15, "idle": 10}


def test_gpu_timeline_ignores_host_events():
    events = (step(0, 100), k(ATTN_FWD, 0, 30), k("aten::add_", 0, 100, cat="cpu_op"),
              k("gloo:send", 0, 100, cat="user_annotation"))
    assert bd.breakdown(Trace(events), RULES).part_us == {"attention/fwd": 30, "idle": 70}


def test_cpu_timeline_ops_and_gloo_work():
    """What a 2-rank gloo run records: nested CPU ops on the main thread, gloo:send/recv
    spans from the post to the wait() that completes them, gloo:all_to_all on gloo's
    worker thread while the caller blocks inside its autograd function."""
    op = "cpu_op"
    events = (
        step(0, 1000),
        k("KVRingAttention", 0, 500, op, 1),  # the strategy's autograd function: other
        k("c10d::send", 10, 20, op, 1),
        k("gloo:send", 20, 400, "user_annotation", 1),
        k("aten::_scaled_dot_product_flash_attention_for_cpu", 30, 300, op, 1),
        k("aten::zeros", 40, 50, op, 1), k("aten::fill_", 41, 49, op, 1),  # inside the kernel
        k("aten::sub", 310, 330, op, 1),  # the merge, while the send is still in flight
        k("_AllToAll", 500, 900, op, 1),
        k("gloo:all_to_all", 520, 880, "user_annotation", 2),  # gloo's worker thread
        k("aten::cat", 880, 900, op, 1),
        k("ProfilerStep#1", 0, 1000, "user_annotation", 1),  # a label, not work
    )
    b = bd.breakdown(Trace(events), RULES)
    assert b.timeline == bd.CPU
    assert b.part_us == {"attention/fwd": 270, "elementwise": 20, "memory": 20,
                         "communication/all_to_all": 360, "communication/send_recv": 100,
                         "other": 130, "idle": 100}
    assert b.exposed_comm_us == 460 and sum(b.part_us.values()) == b.wall_us == 1000
    table = summary.kernel_table(Trace(events), RULES)
    own = {r.name: r.time_ms * 1e3 for r in table.rows}
    # each instant charged once: the kernel's own fill is attention time, not memory
    assert own["aten::_scaled_dot_product_flash_attention_for_cpu"] == 270
    assert own["aten::fill_"] == own["aten::zeros"] == 0
    assert table.total_ms * 1e3 == pytest.approx(b.busy_us)


def test_partition_priority_order():
    spans = [(0.0, 10.0)]
    names = ["other", "communication/all_to_all", "memory", "elementwise", "gemm",
             "attention/bwd"]
    for i, winner in enumerate(names):
        b = bd.partition([(0, 10, p) for p in names[:i + 1]], spans)
        assert b.part_us == {winner: 10, "idle": 0}, winner
    assert bd.ordered(["idle", "other", "attention/fwd", "communication/send_recv", "gemm"]) == \
        ["attention/fwd", "gemm", "communication/send_recv", "other", "idle"]


def test_record_section_is_the_slowest_rank_and_prints():
    a = bd.partition([(0, 60, "attention/fwd"), (60, 90, "communication/send_recv")],
                     [(0, 100)], bd.CPU).to_dict()
    b = bd.partition([(0, 110, "attention/fwd")], [(0, 120)], bd.CPU).to_dict()
    paths = profiling.trace_paths("prof", 2, "zigzag", 2)
    assert paths[1].endswith("prof/2_zigzag/rank1.trace.json.gz")
    keyed = [profiling.trace_paths("prof", 1, "zigzag", 2, key) for key in ("{a}", "{b}")]
    assert keyed[0] != keyed[1]  # a sweep's cases (each its run's case 1) apart
    s = profiling.section([a, b], paths)
    assert s["rank"] == 1 and s["step_ms"] == 0.12 and s["traces"] == paths
    assert s["step_ms_by_rank"] == [0.1, 0.12] and s["exposed_comm_ms_by_rank"] == [0.03, 0]
    lines = summary.detail_lines(s)
    assert lines[0].startswith("Where the time goes (rank 1, the slowest; 1 profiled steps")
    assert "% of step wall time" in lines[1] and "% of busy time" in lines[1]
    assert lines[-2].startswith("  - Exposed Communication: 0.000 ms per step")
    assert lines[-1].endswith("2_zigzag/rank*.trace.json.gz (2 ranks)")
    assert summary.detail_lines({"error": "boom", "traces": paths}) == \
        ["Where the time goes: not profiled (boom)"]


def test_each_step_keeps_its_own_shares_and_wall_time():
    # step 1: 60 µs attention of 100; step 2: 20 µs of 50 waiting on a send, the rest idle
    b = bd.partition([(0, 60, "attention/fwd"), (200, 220, "communication/send_recv")],
                     [(0, 100), (200, 250)], bd.CPU).to_dict()
    assert b["per_iteration_ms"] == [0.1, 0.05]
    assert b["per_iteration"] == [{"attention/fwd": 60.0, "idle": 40.0},
                                  {"communication/send_recv": 40.0, "idle": 60.0}]
    assert b["wall_pct"] == {"attention/fwd": 40.0, "communication/send_recv": 13.333,
                             "idle": 46.667}
