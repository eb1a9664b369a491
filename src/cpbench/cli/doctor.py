"""``cpbench doctor``: preflight a node: GPUs, kernels, versions, environment, cores, a
communication probe.

Check this node before a run: one line per check (ok / warn / error), exit 1 on an error.

Run it on a node (or under srun on every node) before spending cluster hours. It checks the
GPUs visible against the ranks a node will start, their compute capability, every kernel
backend (a tiny forward and backward on each device it claims, with its version, or the real
reason not), the upstream libraries (imported as their strategies import them, and which
strategies each can run), torch / CUDA / NCCL versions, the NCCL and CUDA variables in force
(with what ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` does), the cores each rank may use, and probes
point-to-point and all-to-all between local ranks with the strategies' own calls. Under srun
with one task per node it also probes between the nodes (all-reduce, p2p, all-to-all; NCCL on
GPUs), and says what to set when they cannot reach each other. On a machine without GPUs it
runs too (gloo, CPU kernels) and says why each GPU piece is unavailable.
"""

from __future__ import annotations

import os
import sys
from typing import Iterator

from cpbench.cli import args as cli_args
from cpbench.cli.doctor_nodes import srun_world
from cpbench.errors import UsageError

PROG = "cpbench doctor"
OK, WARN, ERROR = "ok", "warn", "error"
# the variables worth seeing: what changes NCCL's and CUDA's behaviour under a benchmark
ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "CUDA_", "OMP_NUM_THREADS", "TORCH_DISTRIBUTED_")
# the request the kernel check asks each backend about (the GPU default's head dim)
KERNEL_REQUEST = dict(head_dim=128, heads=8, kv_heads=8)

Check = tuple[str, str, str]  # (level, what, detail)


def add_parser(sub) -> None:
    p = cli_args.command(sub, "doctor", __doc__, main)
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="ranks this node will run (default: LOCAL_WORLD_SIZE under "
                        "torchrun, else CPBENCH_GPUS_PER_NODE / SLURM_GPUS_ON_NODE, else the "
                        "GPUs visible, else 2)")
    p.add_argument("--no-probe", action="store_true",
                   help="skip the probe between local ranks (under srun with several tasks, "
                        "one per node, the probe between the nodes still runs)")


def local_ranks(given: int | None, environ=os.environ, gpus: int = 0) -> int:
    """The ranks a node will start, read as the sbatch script and torchrun would."""
    for value in (given, environ.get("LOCAL_WORLD_SIZE"), environ.get("CPBENCH_GPUS_PER_NODE"),
                  environ.get("SLURM_GPUS_ON_NODE")):
        if value:
            return int(value)
    return gpus or 2


def versions() -> Iterator[Check]:
    import torch

    from cpbench import torchcompat
    from cpbench.bench import env

    nccl = env.nccl_version()
    why = torchcompat.out_of_range()
    level = OK if why is None else ERROR if torchcompat.VERSION < torchcompat.FLOOR else WARN
    yield level, "torch", why or (f"torch {torch.__version__}, CUDA "
                                  f"{torch.version.cuda or 'none'} (this build), NCCL "
                                  f"{nccl or 'none'}; supported {torchcompat.supported()}")


def gpus(ranks: int) -> Iterator[Check]:
    """GPUs visible vs ranks per node, and each GPU's compute capability."""
    import torch

    if torch.version.cuda is None:
        yield WARN, "gpus", (f"none: torch {torch.__version__} is built without CUDA; GPU "
                             f"runs need a CUDA build of torch")
        return
    if not torch.cuda.is_available():
        yield WARN, "gpus", (f"none visible (CUDA_VISIBLE_DEVICES="
                             f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}; no driver?)")
        return
    count = torch.cuda.device_count()
    level = ERROR if ranks > count else OK
    yield level, "gpus", (f"{count} visible for {ranks} rank(s) per node" +
                          ("" if level == OK else f": start at most {count} "
                           f"(torchrun --nproc-per-node {count} or gpu)"))
    for i in range(count):
        major, minor = torch.cuda.get_device_capability(i)
        note = fa3_note(major, _fa3_import_error() if major == 9 else None)
        yield OK, f"gpu {i}", f"{torch.cuda.get_device_name(i)}, sm{major}{minor} ({note})"


def _fa3_import_error() -> str | None:
    from cpbench import kernels

    backend = kernels.get("flash-attn3")
    return backend.import_error() if backend.import_error else None


def fa3_note(major: int, fa3_error: str | None) -> str:
    """What a GPU of compute capability ``major`` says of FlashAttention-3: it runs only on
    sm90, and only where its module imports (``fa3_error``: why not)."""
    if major != 9:
        return "FlashAttention-3 needs sm90"
    if fa3_error:
        return f"sm90 runs FlashAttention-3, but it does not import here: {fa3_error}"
    return "FlashAttention-3 can run"


def _kernel_on(backend, device: str) -> str | None:
    """Why ``backend`` cannot run the check's request on ``device``, or None."""
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    why = backend.unsupported_reason(device=device, dtype=dtype, **KERNEL_REQUEST)
    if why is None and device == "cuda" and not torch.cuda.is_available():
        why = "no GPU visible"
    return why


def _smoke(backend, device: str, dead: set[str]) -> str | None:
    """What the backend's tiny forward and backward did on ``device``: None when it ran.
    ``dead``: devices whose context an earlier kernel left unusable (a sticky CUDA error:
    every later call there fails too, so it is not blamed on this backend)."""
    from cpbench.bench.agreement import is_sticky_cuda_error, one_line
    from cpbench.bench.preflight import kernel_smoke

    if device in dead:
        return f"not run on {device}: an earlier kernel left its CUDA context unusable"
    try:
        kernel_smoke(backend, device)
    except Exception as e:  # the kernel's own error, e.g. no image for this GPU's arch
        if is_sticky_cuda_error(e):
            dead.add(device)
        return f"fails on {device}: {one_line(e)}"
    return None


def kernel_checks(on_gpu: bool) -> Iterator[Check]:
    """Every backend on each of its devices: a tiny forward and backward run there (with its
    package's version and file), or why not. A backend that claims a device and fails there
    is an error; on a GPU node no flash kernel for CUDA is one too (``--kernel auto`` would
    refuse to run)."""
    from cpbench import kernels
    from cpbench.bench.preflight import SMOKE

    cuda_flash, shape = False, f"{SMOKE['seqlen']} tokens, head dim {SMOKE['head_dim']}"
    dead: set[str] = set()
    for name in kernels.names()[1:]:
        backend = kernels.get(name)
        why = {d: _kernel_on(backend, d) for d in sorted(backend.devices)}
        claimed = [d for d, w in why.items() if w is None]
        failed = {d: f for d in claimed if (f := _smoke(backend, d, dead)) is not None}
        runs = [d for d in claimed if d not in failed]
        package = backend.provenance() if claimed else None
        where = f" ({package['distribution']} {package['version']}, {package['path']})" \
            if package else ""
        cuda_flash |= "cuda" in runs and name != "torch"
        parts = [f"ran a forward and backward on {', '.join(runs)} ({shape}){where}"] \
            if runs else [f"no forward and backward run{where}"]
        parts += list(failed.values())
        parts += [f"not on {d}: {w}" for d, w in why.items() if w is not None]
        level = ERROR if failed else OK if runs else WARN
        yield level, f"kernel {name}", "; ".join(parts)
    if on_gpu and not cuda_flash:
        yield ERROR, "kernel auto", "no flash kernel runs on this GPU node (see above)"


def upstream_checks(device: str) -> Iterator[Check]:
    """ring-flash-attn, yunchang and transformer_engine.pytorch: imported as their strategies
    import them, and which of those strategies can run on ``device``."""
    from cpbench import strategies
    from cpbench.bench.agreement import one_line
    from cpbench.bench.preflight import UPSTREAM_MODULES, installed, upstream_import

    by_package: dict[str, list] = {}
    for name in strategies.names():
        cls = strategies.get(name)
        if cls.upstream is not None:
            by_package.setdefault(cls.upstream.package, []).append(cls)
    for package in UPSTREAM_MODULES:
        classes = by_package.get(package, [])
        names = ", ".join(c.name for c in classes) or "no strategy"
        what = f"lib {package}"
        if not installed(package):
            yield WARN, what, f"not installed: {names} cannot run (pip install -e '.[gpu]')"
            continue
        version = classes[0].upstream.version() if classes else None
        runs = [c.name for c in classes if c.unavailable(device) is None]
        if not runs:
            reasons = sorted({c.unavailable(device) for c in classes} - {None})
            yield WARN, what, f"{version}: nothing runs on {device}: {'; '.join(reasons)}"
            continue
        try:
            how = upstream_import(package, classes, device)
        except UsageError as e:  # sound, but not on this machine (e.g. flash-attn and no GPU)
            yield WARN, what, f"{version}: cannot run on {device} here: {e} ({names} would be " \
                              "refused)"
            continue
        except Exception as e:  # installed, and broken: its strategies would fail at build
            yield ERROR, what, f"{version} does not import: {one_line(e)} ({names} would fail)"
            continue
        yield OK, what, f"{version} {how}: runs {', '.join(runs)} on {device}"


# what each TORCH_NCCL_ASYNC_ERROR_HANDLING value does when a collective times out (torch's
# ProcessGroupNCCL); torchrun gives its workers 1 when it is unset
ERROR_HANDLING = {
    "0": "nothing happens on a collective timeout: a hung rank holds the GPUs until the job's "
         "time limit; set 1",
    "1": "on a collective timeout the watchdog aborts the communicators and ends the process, "
         "so the launch ends and cpbench's launcher records the case",
    "2": "on a collective timeout the communicators are aborted and the process lives on, its "
         "blocked host syncs returning garbage (cpbench stops that run); set 1",
    "3": "on a collective timeout the process ends without aborting the communicators, so the "
         "launch ends as with 1",
}


def error_handling(environ=os.environ) -> Check:
    """What TORCH_NCCL_ASYNC_ERROR_HANDLING does here, under torchrun."""
    value = environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    if value is None:
        return OK, "nccl error handling", (
            f"TORCH_NCCL_ASYNC_ERROR_HANDLING unset: torchrun gives its workers 1: "
            f"{ERROR_HANDLING['1']}. The sbatch script and cpbench sweep set 1 themselves")
    level = OK if value in ("1", "3") else WARN
    return level, "nccl error handling", (
        f"TORCH_NCCL_ASYNC_ERROR_HANDLING={value}: "
        f"{ERROR_HANDLING.get(value, 'not a value torch knows; set 1')}")


def environment(environ=os.environ) -> Iterator[Check]:
    shown = sorted(f"{k}={v}" for k, v in environ.items() if k.startswith(ENV_PREFIXES))
    yield OK, "environment", ", ".join(shown) if shown else "no NCCL / CUDA variables set"
    yield error_handling(environ)


def cores(ranks: int) -> Iterator[Check]:
    from cpbench.bench import env

    usable = env.cpus_usable()
    per_rank = usable / ranks
    level = OK if per_rank >= 1 else WARN
    yield level, "cores", (f"{usable} usable (of {os.cpu_count()}) for {ranks} rank(s): "
                           f"{per_rank:.1f} each" + ("" if level == OK else
                                                     "; give the job step the node's cores "
                                                     "(srun --cpus-per-task)"))


def probe_checks(ranks: int, gpus: int) -> Iterator[Check]:
    """The probe on local ranks: NCCL on GPUs where there are two or more, else gloo on the
    CPU (what ``cpbench run --nproc`` uses)."""
    from cpbench.bench.probe import probe
    from cpbench.launch import LaunchTimeout, RankError, run_ranks

    device = "cuda" if gpus >= 2 else "cpu"
    ranks = max(2, min(ranks, gpus if device == "cuda" else os.cpu_count() or 2))
    backend = "nccl" if device == "cuda" else "gloo"
    try:
        got = run_ranks(probe, ranks, device, timeout=120, collective_timeout=60,
                        backend=backend)[0]
    except (RankError, LaunchTimeout) as e:
        yield ERROR, "probe", f"{ranks} local ranks could not exchange data: {e}"
        return
    how = f"{ranks} ranks, {backend} on {device}"
    if device == "cpu" and gpus:
        how += " (one GPU: no GPU pair to probe)"
    yield OK, "probe p2p", (f"{how}: latency {got['p2p_latency_us']:.0f} us "
                            f"({got['small_bytes'] // 1024} KiB), bandwidth "
                            f"{got['p2p_gb_s']:.2f} GB/s ({got['large_bytes'] // 2 ** 20} MiB)")
    yield OK, "probe a2a", (f"{how}: bus bandwidth {got['a2a_gb_s']:.2f} GB/s "
                            f"({got['large_bytes'] // 2 ** 20} MiB)")
    if "all_reduce_gb_s" in got:
        yield OK, "probe all-reduce", (f"{how}: bus bandwidth {got['all_reduce_gb_s']:.2f} "
                                       f"GB/s ({got['large_bytes'] // 2 ** 20} MiB)")


def node_checks(where: tuple[int, int, str, int], device: str) -> list[Check]:
    """The probe between the srun tasks (one per node); only task 0 reports it."""
    from cpbench.cli import doctor_nodes

    status, got = doctor_nodes.probe(where, device)
    if where[0] != 0:
        return []
    how = f"{where[1]} nodes, {'nccl on cuda' if device == 'cuda' else 'gloo on cpu'}"
    if status != "ok" or isinstance(got, str):  # ("error", why)
        return [(ERROR, "nodes", f"{how}: the nodes could not exchange data ({got}); "
                                 f"{doctor_nodes.ADVICE}")]
    mib = got["large_bytes"] // 2 ** 20
    return [(OK, "nodes all-reduce", f"{how}: bus bandwidth {got['all_reduce_gb_s']:.2f} GB/s "
                                     f"({mib} MiB)"),
            (OK, "nodes p2p", f"{how}: latency {got['p2p_latency_us']:.0f} us, bandwidth "
                              f"{got['p2p_gb_s']:.2f} GB/s ({mib} MiB)"),
            (OK, "nodes a2a", f"{how}: bus bandwidth {got['a2a_gb_s']:.2f} GB/s ({mib} MiB)")]


def main(args) -> int:
    import torch

    try:
        if args.nproc is not None and args.nproc < 1:
            raise UsageError(f"--nproc must be a positive integer, got {args.nproc}")
    except UsageError as e:
        return cli_args.fail(PROG, e)
    on_gpu = torch.cuda.is_available()
    count = torch.cuda.device_count() if on_gpu else 0
    ranks = local_ranks(args.nproc, gpus=count)
    checks = [*versions(), *gpus(ranks), *kernel_checks(on_gpu),
              *upstream_checks("cuda" if on_gpu else "cpu"), *environment(), *cores(ranks)]
    for line in _lines(checks):
        sys.stdout.write(line)
    probed = [] if args.no_probe else _probed(ranks, count)
    where = srun_world()
    if where is not None:  # one task per node: the probe between them
        probed += node_checks(where, "cuda" if on_gpu else "cpu")
    for line in _lines(probed):
        sys.stdout.write(line)
    checks += probed
    return 1 if any(level == ERROR for level, _, _ in checks) else 0


def _probed(ranks: int, gpus: int) -> list[Check]:
    """The probe, its progress on stderr meanwhile (starting the ranks takes seconds)."""
    from cpbench.report import console

    with console.transient_progress(), console.Ticker("doctor") as ticker:
        ticker.set(f"probing the links between {max(2, ranks)} local ranks")
        return list(probe_checks(ranks, gpus))


def _lines(checks: list[Check]) -> Iterator[str]:
    for level, what, detail in checks:
        yield f"{level:<5}  {what:<22} {detail}\n"
