"""``cpbench profile summarize`` on the profiles people already have: seed 000's
torch.profiler table (with and without host prefixes), seed 002's nsys kernel summary (and
the same summary as nsys's CSV and column layouts), Chrome traces; malformed input is one
line naming the file and line, exit 2."""

import gzip
import json
from pathlib import Path

import pytest

from cpbench import cli

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SEED_000 = FIXTURES / "000_profiler_zigzag_32gpu.txt"
SEED_002 = FIXTURES / "002_nsys_kernel_summary.txt"


def _summarize(capsys, *args):
    code = cli.main(["profile", "summarize", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def _json(capsys, *args) -> list[dict]:
    code, out, err = _summarize(capsys, *args, "--format", "json")
    assert code == 0, err
    return json.loads(out)


def _top(rows) -> dict[str, float]:
    return {r["group"]: r["percent"] for r in rows if r.get("level") == 1}


def _bad(capsys, *args) -> str:
    code, out, err = _summarize(capsys, *args)
    assert code == 2 and not out, (code, out, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_seed_000_attention_and_nccl_shares(capsys):
    code, out, err = _summarize(capsys, SEED_000)
    assert code == 0, err
    rows = _json(capsys, SEED_000)
    top = _top(rows)
    assert 63 <= top["attention"] <= 64
    nccl = next(r for r in rows if r["group"] == "communication/send_recv")
    assert 34 <= nccl["percent"] <= 35
    assert nccl["kernels"][0]["name"].startswith("ncclDevKernel_SendRecv")
    assert abs(sum(top.values()) - 100) < 0.01
    # fwd, bwd and the helper kernels (dot_do_o, convert_dq) are all attention
    sub = {r["group"]: r for r in rows if r["level"] == 2}
    helper = {k["name"].split("<")[0] for k in sub["attention/helper"]["kernels"]}
    assert helper == {"void flash_bwd_dot_do_o_kernel", "void flash_bwd_convert_dq_kernel"}
    assert "attention" in out and "63.50" in out and "34.59" in out


def test_seed_000_without_host_prefix_and_interleaved(capsys, tmp_path):
    lines = SEED_000.read_text().splitlines()
    bare = tmp_path / "bare.txt"
    bare.write_text("\n".join(line.removeprefix("g43: ") for line in lines) + "\n")
    # another host's lines interleaved with g43's table are not g43's rows
    mixed = tmp_path / "mixed.txt"
    mixed.write_text("\n".join(x for line in lines for x in (line, "g7: some other output"))
                     + "\n")
    expected = _top(_json(capsys, SEED_000))
    assert _top(_json(capsys, bare)) == expected
    assert _top(_json(capsys, mixed)) == expected


def test_seed_002_sums_to_100_and_gemm_is_largest(capsys):
    code, out, err = _summarize(capsys, SEED_002)
    assert code == 0, err
    top = _top(_json(capsys, SEED_002))
    assert abs(sum(top.values()) - 100) <= 0.5
    assert max(top, key=top.get) == "gemm"
    assert "lines 206-272 follow the table and were not read" in out


def _nsys_rows():
    """Seed 002's table as (percent, total ns, instances, name)."""
    unit = {"s": 1e9, "ms": 1e6, "μs": 1e3, "ns": 1.0}
    rows = []
    for line in SEED_002.read_text().splitlines()[1:]:
        if not line.strip():
            break
        cells = line.split("\t")
        value, u = cells[1].split()
        rows.append((cells[0].rstrip("%"), round(float(value) * unit[u]), cells[2], cells[8]))
    return rows


def test_nsys_csv_and_column_layouts_read_the_same(capsys, tmp_path):
    rows = _nsys_rows()
    csv_file = tmp_path / "kern_sum.csv"
    csv_file.write_text('"Time (%)","Total Time (ns)","Instances","Avg (ns)","Med (ns)",'
                        '"Min (ns)","Max (ns)","StdDev (ns)","Name"\n' + "".join(
                            f'{p},{t},{n},0,0,0,0,0,"{name}"\n' for p, t, n, name in rows))
    columns = tmp_path / "kern_sum.txt"
    columns.write_text(
        "\n ** CUDA GPU Kernel Summary (cuda_gpu_kern_sum):\n\n"
        " Time (%)  Total Time (ns)  Instances  Name\n"
        " --------  ---------------  ---------  ----\n" + "".join(
            f" {p:>8}  {t:>15,}  {n:>9}  {name}\n" for p, t, n, name in rows) + "\n")
    expected = _top(_json(capsys, SEED_002))
    for f in (csv_file, columns):
        got = _top(_json(capsys, f))
        assert got.keys() == expected.keys()
        assert all(abs(got[g] - expected[g]) < 0.01 for g in got), (f, got, expected)


def _trace(events, path: Path, gz=False) -> Path:
    text = json.dumps({"traceEvents": events})
    if gz:
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def test_chrome_trace_json_and_gz_with_exposed_communication(capsys, tmp_path):
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "cpbench/step", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "flash_fwd_kernel<…>", "ts": 0, "dur": 50},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_SendRecv(x)", "ts": 10, "dur": 70},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 0, "dur": 100},  # host side
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "python"}},
    ]
    for f in (_trace(events, tmp_path / "t.json"), _trace(events, tmp_path / "t.json.gz", True)):
        rows = _json(capsys, f)
        assert _top(rows) == {"attention": pytest.approx(50 / 120 * 100),
                              "communication": pytest.approx(70 / 120 * 100)}
        b = rows[-1]["breakdown"]
        assert b["exposed_comm_ms"] == 0.03 and b["exposed_comm_pct"] == 30.0
        assert b["wall_pct"] == {"attention/fwd": 50.0, "communication/send_recv": 30.0,
                                 "idle": 20.0}
        code, out, _ = _summarize(capsys, f)
        assert code == 0 and "Exposed Communication: 0.030 ms per step (30.00 %" in out


def test_malformed_inputs_are_one_line_naming_the_line(capsys, tmp_path):
    lines = SEED_000.read_text().splitlines()
    lines[3] = lines[3].replace("11.306s ", "11.3x6s ")
    bad_time = tmp_path / "bad_time.txt"
    bad_time.write_text("\n".join(lines) + "\n")
    assert f"{bad_time}:4: cannot read '11.3x6s'" in _bad(capsys, bad_time)

    lines = SEED_002.read_text().splitlines()
    lines[4] = "\t".join(lines[4].split("\t")[:5])
    short = tmp_path / "short.txt"
    short.write_text("\n".join(lines) + "\n")
    assert f"{short}:5: 5 tab-separated fields where the header (line 1) has 9" \
        in _bad(capsys, short)

    truncated = tmp_path / "cut.json"
    truncated.write_text('{"traceEvents": [\n{"ph": "X", "name": "k",\n')
    assert f"{truncated}:3: not valid JSON" in _bad(capsys, truncated)

    no_dur = _trace([{"ph": "X", "name": "k", "ts": 1}], tmp_path / "no_dur.json")
    assert "traceEvents[0] ('k'): `ts` and `dur` must be numbers" in _bad(capsys, no_dur)

    garbage = tmp_path / "g.json.gz"
    garbage.write_bytes(b"\x1f\x8b" + b"not gzip")
    assert "does not decompress" in _bad(capsys, garbage)

    prose = tmp_path / "notes.txt"
    prose.write_text("kernel times: roughly half attention\n")
    assert f"{prose}:1: no profile found" in _bad(capsys, prose)
    assert "cannot read it" in _bad(capsys, tmp_path / "missing.txt")
    # nothing printed for the good file before the bad one: all inputs are read first
    _bad(capsys, SEED_000, prose)


def test_a_real_key_averages_table_cut_at_a_row_limit(capsys, tmp_path):
    """torch's own layout (a rule above and below the header), Self CPU when there is no
    device column, and the time of the rows a row limit left out kept as a row of its own."""
    import torch
    from torch.profiler import profile

    a = torch.randn(64, 64)
    with profile() as prof:
        (a @ a).add_(1).sum()
    table = tmp_path / "cpu.txt"
    table.write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=1))
    rows = _json(capsys, table)
    assert abs(sum(_top(rows).values()) - 100) < 0.01
    other = next(r for r in rows if r["group"] == "other")
    assert "(not listed in the table)" in {k["name"] for k in other["kernels"]}
    code, out, _ = _summarize(capsys, table)
    assert code == 0 and "torch.profiler table (Self CPU)" in out


def _rank_trace(path: Path, step_us: int) -> Path:
    """A rank's trace as ``cpbench run --profile`` names it: one step of ``step_us``, a
    forward kernel the whole step."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return _trace([{"ph": "X", "cat": "user_annotation", "name": "cpbench/step", "ts": 0,
                    "dur": step_us},
                   {"ph": "X", "cat": "kernel", "name": "flash_fwd_kernel<…>", "ts": 0,
                    "dur": step_us}], path, gz=True)


def test_a_cases_rank_traces_summarize_the_slowest_rank_and_say_which(capsys, tmp_path):
    """The step ends when its last rank does: of rank0..2's traces, rank 1's (the longest
    step) is summarized, saying so; --every-rank gives each; another file is kept."""
    case = tmp_path / "prof" / "1_zigzag_abc"
    traces = [_rank_trace(case / f"rank{r}.trace.json.gz", us)
              for r, us in enumerate((100, 300, 200))]
    other = _trace([{"ph": "X", "cat": "kernel", "name": "flash_fwd_kernel<…>", "ts": 0,
                     "dur": 5}], tmp_path / "elsewhere.json")
    code, out, err = _summarize(capsys, *traces, other)
    assert code == 0, err
    assert out.count("Chrome trace") == 2 and f"{case}/rank1.trace.json.gz:" in out
    assert "  rank 1 of 3, the slowest (ms a step, by rank: 0: 0.100, 1: 0.300, 2: 0.200)" in out
    assert "rank0.trace" not in out and "rank2.trace" not in out and "elsewhere.json:" in out
    code, out, _ = _summarize(capsys, *traces, "--every-rank")
    assert code == 0 and out.count("Chrome trace") == 3 and "the slowest" not in out
