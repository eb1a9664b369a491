"""Model presets (``cpbench.models``): the table's own sanity, ``--model`` setting the
attention fields with the flags beside it overriding and reported, ``cpbench models``, the
sweep's ``model:`` key, and the simulator pricing V's width and the sinks."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from cpbench import cli, models, strategies
from cpbench.config import AttentionConfig
from cpbench.errors import UsageError
from cpbench.metrics import attention_flops, pairs_flops
from cpbench.sim import hardware, model, sharing
from cpbench.topology import Topology

REPO = Path(__file__).resolve().parents[2]
REQUIRED = ("llama3-8b", "llama3-70b", "llama3-405b", "qwen3-235b-a22b", "deepseek-v3",
            "kimi-k2", "gpt-oss-120b", "gpt-oss-120b-swa")


# -- the table ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(models.PRESETS))
def test_every_preset_is_a_valid_problem_with_a_named_source(name):
    p = models.PRESETS[name]
    assert p.name == name
    assert p.heads % p.kv_heads == 0, f"{name}: kv heads must divide heads"
    assert p.head_dim > 0 and p.v_head_dim > 0 and p.dtype == "bf16"
    # a source names a file or paper and the fields read from it, not just a model name
    assert len(p.source) > 60 and re.search(r"\.(py|json|yml|md)\b|README|arXiv", p.source)
    attn = AttentionConfig(**p.fields())
    assert (attn.heads, attn.num_kv_heads, attn.head_dim, attn.dv) == \
        (p.heads, p.kv_heads, p.head_dim, p.v_head_dim)
    assert (attn.window_size, attn.sinks, attn.dtype) == (p.window_size, p.sinks, p.dtype)


def test_the_issue_s_models_are_covered_with_their_published_shapes():
    assert set(REQUIRED) <= set(models.PRESETS) and len(models.PRESETS) >= 8
    shape = {n: (p.heads, p.kv_heads, p.head_dim, p.v_head_dim)
             for n, p in models.PRESETS.items()}
    assert shape["deepseek-v3"] == (128, 128, 192, 128)  # MLA: 128 + 64 rotary, V 128
    assert shape["kimi-k2"] == (64, 64, 192, 128)
    assert shape["gpt-oss-120b"] == shape["gpt-oss-120b-swa"] == (64, 8, 64, 64)
    assert shape["llama3-405b"] == (128, 8, 128, 128)
    full, swa = models.get("gpt-oss-120b"), models.get("gpt-oss-120b-swa")
    assert full.sinks and swa.sinks and full.window_size is None
    assert swa.window_size == (127, 0)  # 128 keys: itself and the 127 before
    assert dataclasses.replace(swa, name=full.name, model=full.model, source=full.source,
                               window_size=None) == full


def test_fields_leave_equal_widths_and_heads_to_the_config_s_defaults():
    f = models.get("llama3-8b").fields()
    assert "v_head_dim" not in f and f["kv_heads"] == 8
    f = models.get("deepseek-v3").fields()
    assert "kv_heads" not in f and f["v_head_dim"] == 128 and f["head_dim"] == 192


# -- --model and the flags beside it -----------------------------------------------------------

def test_resolve_sets_the_preset_and_the_given_flags_win_and_are_reported():
    fields, over = models.resolve("gpt-oss-120b-swa", {"seqlen": 1024, "heads": 16,
                                                       "dtype": "bf16"})
    assert fields["heads"] == 16 and fields["seqlen"] == 1024  # given wins; others kept
    assert (fields["kv_heads"], fields["head_dim"], fields["window_size"], fields["sinks"]) == \
        (8, 64, (127, 0), True)
    assert over == {"heads": (16, 64)}  # dtype equals the preset's: not an override
    line = models.note("gpt-oss-120b-swa", over)
    assert "\n" not in line and "--heads 16 (preset 64)" in line and "window 127,0" in line


def test_an_override_of_a_field_the_preset_leaves_to_its_default_is_reported():
    fields, over = models.resolve("deepseek-v3", {"v_head_dim": 192, "kv_heads": 16})
    assert fields["v_head_dim"] == 192 and fields["kv_heads"] == 16
    assert over == {"v_head_dim": (192, 128), "kv_heads": (16, 128)}
    assert "--kv-heads 16 (preset 128)" in models.note("deepseek-v3", over)
    # the preset's own value given again is no override
    assert models.resolve("deepseek-v3", {"kv_heads": 128})[1] == {}
    over = models.resolve("gpt-oss-120b-swa", {"window_size": (63, 0), "sinks": False})[1]
    assert "--window-size 63,0 (preset 127,0), --sinks off (preset on)" in \
        models.note("gpt-oss-120b-swa", over)


def test_no_model_passes_the_flags_through():
    assert models.resolve(None, {"heads": 4}) == ({"heads": 4}, {})


def test_unknown_model_suggests_the_nearest_and_where_the_list_is():
    with pytest.raises(UsageError) as e:
        models.get("llama3-8bb")
    assert "did you mean 'llama3-8b'" in str(e.value)
    assert "`cpbench models`" in str(e.value) and len(str(e.value)) <= 100


@pytest.mark.parametrize("command", ["run", "simulate", "dryrun"])
def test_unknown_model_is_one_line_exit_2_in_every_command(capsys, command):
    code = cli.main([command, "--model", "nope", "--nproc", "2"] if command == "run"
                    else [command, "--model", "nope"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "unknown model 'nope'" in lines[0]
    assert "cpbench models" in lines[0] and len(lines[0]) <= 120


def test_cpbench_models_lists_every_preset_with_its_source(capsys):
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    for name, p in models.PRESETS.items():
        assert re.search(rf"^  {re.escape(name)} +{re.escape(p.shape())}", out, re.M)
    assert out.count("source: ") == len(models.PRESETS)
    assert max(map(len, out.splitlines())) <= 120


# -- the simulator -----------------------------------------------------------------------------

def test_flops_count_each_matmul_on_its_own_width():
    b, sq, sk, h, d, dv = 2, 5, 7, 3, 192, 128
    mm = 2 * b * sq * sk * h  # one (sq x w) @ (w x sk) product per unit of width w
    fwd = mm * d + mm * dv  # S = Q Kᵀ, O = P V
    bwd = mm * d + 2 * mm * dv + 2 * mm * d  # S again; dP = dO Vᵀ, dV = Pᵀ dO; dQ, dK
    kw = dict(batch=b, seqlen_q=sq, seqlen_k=sk, heads=h, head_dim=d, causal=False,
              v_head_dim=dv)
    assert attention_flops(**kw) == pytest.approx(fwd)
    assert attention_flops(**kw, mode="bwd") == pytest.approx(bwd)
    assert attention_flops(**kw, mode="fwd_bwd") == pytest.approx(fwd + bwd)
    assert pairs_flops(sq * sk, batch=b, heads=h, head_dim=d, mode="bwd", v_head_dim=dv) == \
        pytest.approx(bwd)
    # equal widths: the 4·D and 2.5 × of before, exactly
    kw["v_head_dim"] = d
    assert attention_flops(**kw, mode="bwd") == attention_flops(**{**kw, "v_head_dim": None},
                                                                mode="bwd")


def _machine(**passes) -> hardware.Hardware:
    flat = [[1, 100.0], [2, 100.0]]
    return hardware.from_dict({
        "name": "test", "gpus_per_node": 4, "nodes": 2, "memory_gib": 80.0,
        "peak_tflops_bf16": 1e6, "kernel": {"fwd": flat, "bwd": flat},
        "intra_node": {"bandwidth_gbs": 100.0, "latency_us": 0.0},
        "inter_node": {"bandwidth_gbs_per_gpu": 50.0, "node_bandwidth_gbs": 200.0,
                       "latency_us": 0.0}, **passes})


def _predict(name, hw=None, **attn):
    a = AttentionConfig(**{**dict(batch=1, seqlen=8192, heads=8, head_dim=192, dtype="bf16"),
                           **attn})
    topo = Topology(world_size=8, ranks_per_node=4)
    return model.predict(name, strategies.get(name).Options(), a, topo, hw or _machine())


@pytest.mark.parametrize("name", ["ring", "ulysses"])
def test_a_narrower_v_costs_less_time_and_memory(name):
    wide, mla, narrow = (_predict(name, v_head_dim=dv) for dv in (192, 128, 64))
    assert narrow.fwd_s < mla.fwd_s < wide.fwd_s
    assert narrow.bwd_s < mla.bwd_s < wide.bwd_s
    assert narrow.memory_bytes < mla.memory_bytes < wide.memory_bytes


def test_the_merge_and_gradient_passes_run_on_their_own_widths():
    hw = _machine(merge={"fixed_us": 0.0, "ns_per_element": 1.0},
                  accumulate={"fixed_us": 0.0, "ns_per_element": 1.0})
    # 2 query rows x 1 head, 3 key rows x 1 kv head; D 6, DV 2
    assert sharing.passes_s(hw, "fwd", q=12, kv=18, out=4, v=6) == pytest.approx(4e-9)
    assert sharing.passes_s(hw, "bwd", q=12, kv=18, out=4, v=6) == pytest.approx(36e-9)
    assert sharing.passes_s(hw, "bwd", q=12, kv=18) == pytest.approx(48e-9)  # equal widths


def test_sinks_add_their_pass_once_per_query_row_and_nothing_else():
    hw = _machine(merge={"fixed_us": 0.0, "ns_per_element": 1.0},
                  accumulate={"fixed_us": 0.0, "ns_per_element": 2.0})
    for name in ("ring", "ulysses"):
        plain, sinks = _predict(name, hw), _predict(name, hw, sinks=True)
        rows = 8192 * 8 * 192 / 8  # this rank's query rows x heads x out's width
        assert sinks.fwd_s - plain.fwd_s == pytest.approx(rows * 1e-9)
        assert sinks.bwd_s - plain.bwd_s == pytest.approx(2 * rows * 1e-9)
        assert sinks.memory_bytes == plain.memory_bytes


def test_simulate_with_model_prints_tables(capsys):
    code = cli.main(["simulate", "--model", "deepseek-v3", "--hardware", "h100-sxm",
                     "--nodes", "1", "--seqlen", "32K", "--strategy", "ring,ulysses"])
    out, err = capsys.readouterr()
    assert code == 0 and "Benchmark Summary" in out and "ulysses" in out
    assert "--model deepseek-v3: H=128 KV=128 D=192 DV=128" in err


def test_simulate_with_model_reports_its_overrides(capsys):
    code = cli.main(["simulate", "--model", "gpt-oss-120b", "--hardware", "h100-sxm",
                     "--nodes", "1", "--seqlen", "32K", "--strategy", "ring", "--heads", "32"])
    err = capsys.readouterr().err
    assert code == 0 and "overridden: --heads 32 (preset 64)" in err


# -- the sweep ---------------------------------------------------------------------------------

def test_the_gpt_oss_sweep_runs_both_layer_kinds_with_the_preset_s_shape():
    from cpbench import sweep

    s = sweep.load(REPO / "configs" / "gpt_oss_node8.yaml")
    kinds = {c.settings.get("window_size") for c in s.cases}
    assert kinds == {None, (127, 0)}
    for c in s.cases:
        got = {k: c.settings.get(k) for k in ("heads", "kv_heads", "head_dim", "sinks")}
        assert got == {"heads": 64, "kv_heads": 8, "head_dim": 64, "sinks": True}, c.label


def test_a_sweep_case_s_own_settings_override_its_model(tmp_path):
    from cpbench import sweep

    path = tmp_path / "s.yaml"
    path.write_text("base: {nproc: 2, seqlen: 256, dtype: fp32}\n"
                    "cases:\n  - {model: kimi-k2, strategy: ring, heads: 4}\n")
    (case,) = sweep.load(path).cases
    assert (case.settings["heads"], case.settings["head_dim"], case.settings["v_head_dim"],
            case.settings["dtype"]) == (4, 192, 128, "fp32")
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: {nproc: 2}\ncases:\n  - {model: nope, strategy: ring}\n")
    with pytest.raises(sweep.SweepError, match="unknown model 'nope'"):
        sweep.load(bad)


def test_sweep_run_flags_take_model_and_write_its_fields_out(capsys):
    code = cli.main(["sweep", "--dry-run", "--run", "--model", "kimi-k2", "--nproc", "2",
                     "--strategy", "ring", "--heads", "4", "--seqlen", "256", "--dtype", "fp32",
                     "--out", "/tmp/never-written.jsonl"])
    out, err = capsys.readouterr()
    assert code == 0 and "--model" not in out  # each launch gets the fields, not the name
    assert "--heads 4 --head-dim 192" in out and "--v-head-dim 128" in out
    assert err.count("--model kimi-k2") == 1 and "--heads 4 (preset 64)" in err


def test_only_rank_0_says_the_model_line_under_torchrun(monkeypatch, capsys):
    from cpbench.cli.args import say

    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1",
           "MASTER_ADDR": "127.0.0.1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    say("the line")
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    say("the line")
    assert capsys.readouterr().err == "cpbench: the line\n"
