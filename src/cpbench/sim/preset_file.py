"""A measured hardware preset as YAML: the format of ``cpbench/sim/presets/*.yaml`` (read by
``cpbench.sim.hardware``), each value with a comment saying it was measured, when and how.
``scripts/calibrate_hardware.py`` (a fit to published rows) writes the same fields."""

from __future__ import annotations

from cpbench import metrics
from cpbench.sim.calibrate import PROBE_SIDE, STEADY, TINY, Spec, fit_line


def curves(kernel_ms: dict[int, tuple[float, float]], spec: Spec, overhead_ms: float,
           causal: bool) -> tuple[list[list[float]], list[list[float]]]:
    """(fwd points, bwd points): each block's FLOPs over its time less the per-step overhead
    (never less than half its time: a noisy tiny block must not make a rate out of
    nothing)."""
    fwd: list[list[float]] = []
    bwd: list[list[float]] = []
    for side in spec.sides:
        t_fwd, t_bwd = kernel_ms[side]
        flops = metrics.attention_flops(batch=1, seqlen_q=side, seqlen_k=side,
                                        heads=spec.heads, head_dim=spec.head_dim, causal=causal)
        for points, t, f in ((fwd, t_fwd, flops), (bwd, t_bwd, flops * metrics.BWD_FACTOR)):
            net = max(t - overhead_ms, t / 2)
            points.append([side, round(f / (net / 1e3) / 1e12, 5)])
    return fwd, bwd


def _num(x: float, digits: int = 3) -> str:
    """``digits`` significant digits that YAML reads as a number: it reads 1e-09 as text,
    1.0e-09 as a number."""
    text = f"{x:.{digits}g}"
    mantissa, e, exponent = text.partition("e")
    return f"{mantissa}.0e{exponent}" if e and "." not in mantissa else text


def _flow(points) -> str:
    return "[" + ", ".join(f"[{int(s)}, {_num(t, 4)}]" for s, t in points) + "]"


def render(measured: dict, spec: Spec, memory_gib: float) -> str:
    """The preset's YAML text."""
    env = measured["env"]
    when = env["utc"]
    how = (f"cpbench calibrate on {env['hostnames'][0]}, {measured['world']} ranks "
           f"({spec.ranks_per_node} a node), {measured['threads_per_rank']} thread(s) a rank, "
           f"torch {env['torch']}, {env['device_name']}")
    kernel_ms = measured["kernel_ms"]
    overhead_ms = kernel_ms[False][TINY][0]  # the tiny block's forward: what any call pays
    fwd, bwd = curves(kernel_ms[False], spec, overhead_ms, causal=False)
    fwd_c, bwd_c = curves(kernel_ms[True], spec, overhead_ms, causal=True)
    peak = max(t for _, t in fwd + bwd + fwd_c + bwd_c)
    links = measured["links_ms"]
    lines = [
        f"# Measured by {how}, {when}.",
        f"# Kernel: the `auto` kernel on full and causal {spec.dtype} blocks of sides "
        f"{','.join(map(str, spec.sides))},",
        f"# H={spec.heads}, D={spec.head_dim}, every rank at once, cpbench run's timer: "
        "each point the fastest pass",
        "# (the slowest rank's time of each). Links: batch_isend_irecv with a partner / "
        "all_to_all_single,",
        "# 4 KiB-16 MiB, least-squares latency + bytes / bandwidth through each size's "
        "fastest iteration.",
        *_load_lines(measured.get("load"), when),
        f"name: calibrated {env['device_name']} ({env['hostnames'][0]})",
        f"description: measured by cpbench calibrate, {when}",
        f"gpus_per_node: {spec.ranks_per_node}  # ranks per node when measured",
        f"nodes: {measured['world'] // spec.ranks_per_node}  # nodes when measured",
        f"memory_gib: {memory_gib:.1f}  # total memory per rank ({spec.device}), read {when}",
        f"peak_tflops_bf16: {_num(peak, 4)}  # no datasheet figure: the highest rate measured",
        f"dtypes: [{spec.dtype}]  # the dtype the kernel was measured in",
        "kernel:",
        "  name: measured  # the kernel `cpbench run` uses here (auto), as calibrate timed it",
        f"  # measured {when}: TFLOP/s of the rest of each call (its time less the overhead)",
        f"  fwd: {_flow(fwd)}",
        f"  bwd: {_flow(bwd)}",
        "  # the same on causal (diagonal) blocks, FLOPs counted as half the square's",
        f"  fwd_causal: {_flow(fwd_c)}",
        f"  bwd_causal: {_flow(bwd_c)}",
        f"  step_overhead_us: {overhead_ms * 1e3:.1f}  # measured {when}: a {TINY}-token "
        "block's forward",
    ]
    probe = measured["probe_ms"]
    state = "" if probe["steady"] else (
        f"  # NOT STEADY: the probes moved more than {STEADY:.0%} in each of {probe['tries']} "
        "tries; the machine changed while it was measured")
    lines += [f"# the machine's state, read before and after (cpbench simulate --self-check "
              f"compares its own probes with it): a {PROBE_SIDE}-token full forward, H="
              f"{spec.heads}, D={spec.head_dim}, with every rank busy / rank 0 alone",
              f"probe: {{side: {PROBE_SIDE}, heads: {spec.heads}, head_dim: {spec.head_dim}, "
              f"busy_ms: {_num(probe['after'][0])}, alone_ms: {_num(probe['after'][1])}}}"
              f"{state}"]
    shared = measured["sharing"]
    clamped = shared.get("clamped", {})
    lines += [f"idle_speedup: {_num(shared['idle_speedup'])}  # measured {when}: a forward "
              "alone vs with every rank busy (the median over the larger blocks)"
              + _clamp_note(clamped, "idle_speedup", 1)]
    if shared["overlapped"] is not None:
        lines += [f"overlapped: {_num(shared['overlapped'])}  # measured {when}: what an "
                  "exchange posted before a forward and awaited after adds to it, over its "
                  "time alone (the median over the larger blocks)"
                  + _clamp_note(clamped, "overlapped", 0)]
    for what, points in measured["passes_ms"].items():
        fixed_us, per_element_ns = _per_element(points)
        lines += [f"{what}:  # measured {when}: " + PASSES[what],
                  f"  fixed_us: {fixed_us:.1f}",
                  f"  ns_per_element: {_num(per_element_ns)}"]
    lines += _link_lines(links, when)
    return "\n".join(lines) + "\n"


def _clamp_note(clamped: dict, key: str, bound: float) -> str:
    """Said beside a value the model could not take as measured (see ``clamp_lines``)."""
    return "" if key not in clamped else \
        f"; CLAMPED: measured {_num(clamped[key])}, the model takes >= {bound:g}"


def clamp_lines(measured: dict) -> list[str]:
    """One line per value clamped to the model's range, for stderr."""
    return [f"{key} measured {_num(value)}, written as {_num(measured['sharing'][key])} (the "
            f"model's range); a reading outside it says the machine was not steady"
            for key, value in measured["sharing"].get("clamped", {}).items()]


def _load_lines(load: dict | None, when: str) -> list[str]:
    """The load meter's reading while calibrate measured: ``cpbench simulate --self-check``
    refuses to score against a preset without a reading or whose ``share`` is above the
    self-check's own ``--load-limit``; ``busy`` is calibrate's verdict under its limit."""
    if load is None:
        return ["# load: not read (the load meter needs Linux's /proc)"]
    mark = ("  # BUSY: above calibrate's limit; the self-check refuses a share above its own"
            if load["busy"] else "")
    return [f"# the share of the cores other processes used while it measured, {when}, "
            f"and the limit (calibrate --load-limit):",
            f"load: {{share: {_num(load['share'])}, wall_s: {load['wall_s']:.0f}, "
            f"limit: {_num(load['limit'])}, busy: {str(load['busy']).lower()}}}{mark}"]


PASSES = {"merge": "a block's log-sum-exp merge into the fp32 (out, lse) of its rows",
          "accumulate": "an fp32 += of a block's gradient (dq, dk, dv partial sums)"}


def _per_element(points: list) -> tuple[float, float]:
    """(fixed µs, ns per element) of the least-squares line through (elements, ms)."""
    lat_us, rate = fit_line(points)  # the same fit as a link's: latency, "GB/s" of elements
    return lat_us, 1.0 / rate


def _link_lines(links: dict, when: str) -> list[str]:
    intra = links.get("intra") or links["all_to_all"]  # all_to_all: measured on any topology
    lat, bw = fit_line(intra)
    where = "a partner in the node" if "intra" in links else "all_to_all (one rank a node)"
    out = ["intra_node:",
           f"  bandwidth_gbs: {_num(bw)}  # measured {when}: batch_isend_irecv with {where}",
           f"  latency_us: {lat:.1f}  # measured {when}: the fit's intercept"]
    if "inter" in links:
        ilat, ibw = fit_line(links["inter"])
        out += ["inter_node:",
                f"  bandwidth_gbs_per_gpu: {_num(ibw)}  # measured {when}: batch_isend_irecv "
                "with the same slot on the next node",
                f"  node_bandwidth_gbs: {_num(ibw)}  # not measured on its own: one pair's",
                f"  latency_us: {ilat:.1f}  # measured {when}: the fit's intercept"]
    else:
        out += ["inter_node:  # not measured (one node): the intra-node figures",
                f"  bandwidth_gbs_per_gpu: {_num(bw)}",
                f"  node_bandwidth_gbs: {_num(bw)}",
                f"  latency_us: {lat:.1f}"]
    alat, abw = fit_line(links["all_to_all"])
    out += ["all_to_all:  # measured, for reference (the model prices all-to-alls on the links)",
            f"  bandwidth_gbs: {_num(abw)}  # all_to_all_single over the world, {when}",
            f"  latency_us: {alat:.1f}"]
    return out
