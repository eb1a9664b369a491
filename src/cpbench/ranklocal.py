"""State kept per rank: the process's own, or the thread's where ranks are threads.

One rank per process (gloo, NCCL, torchrun) keeps its state in module globals, visible from
every thread of the process (a CUDA backward runs on autograd's device thread). Under
``--launcher threads`` (``cpbench.threadpg``) several ranks share the process, each in a thread
marked with ``enter(rank)``: there each rank's state is its thread's own (and autograd runs a
backward on the calling thread, so nothing of a rank runs elsewhere). Modules that keep state
per rank (``topology``'s group cache, ``comm``'s counters, patched library functions) ask
``slot`` for it instead of holding a global.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterator

_PROCESS: dict[str, Any] = {}
_local = threading.local()
_lock = threading.Lock()


def enter(rank: int) -> None:
    """Mark the calling thread as rank ``rank``'s (the threads launcher, once per thread)."""
    _local.rank, _local.state = rank, {}


def leave() -> None:
    _local.rank = _local.state = None


def rank() -> int | None:
    """The rank whose thread this is; None outside a rank thread (one rank per process, or
    the launcher's own thread)."""
    return getattr(_local, "rank", None)


def slot(name: str, factory: Callable[[], Any]) -> Any:
    """This rank's value of ``name`` (made by ``factory`` on first use)."""
    state = getattr(_local, "state", None)
    state = _PROCESS if state is None else state
    if name not in state:
        state[name] = factory()
    return state[name]


# (id of the first module, attribute) -> [the original, how many hold its dispatcher now]
_PATCHED: dict[tuple[int, str], list] = {}


def _install(modules: tuple, name: str) -> tuple[tuple[int, str], Callable]:
    """Put the dispatching function in place (once), count one more holder; (key, the
    original)."""
    key = (id(modules[0]), name)
    with _lock:
        entry = _PATCHED.get(key)
        if entry is None:
            original = getattr(modules[0], name)
            entry = _PATCHED[key] = [original, 0]
            dispatcher = _dispatcher(key, original)
            for m in modules:
                setattr(m, name, dispatcher)
        entry[1] += 1
    return key, entry[0]


def _release(modules: tuple, key: tuple[int, str]) -> None:
    with _lock:
        entry = _PATCHED[key]
        entry[1] -= 1
        if entry[1] == 0:
            for m in modules:
                setattr(m, key[1], entry[0])
            del _PATCHED[key]


@contextlib.contextmanager
def hold(modules: tuple, names: tuple[str, ...]) -> Iterator[None]:
    """Keep the dispatching functions of ``names`` in place for the block, patched or not:
    ranks as threads then never see them come and go (torch compares a ``P2POp``'s op, taken
    when it was made, with ``isend`` when it is posted)."""
    keys = [_install(modules, n)[0] for n in names]
    try:
        yield
    finally:
        for key in keys:
            _release(modules, key)


@contextlib.contextmanager
def patch(modules: tuple, name: str, make: Callable[[Callable], Callable]) -> Iterator[None]:
    """Within the block, this rank's calls of ``modules[i].name`` go to ``make(original)``;
    other ranks' calls go where they went. The same dispatching function stands in every
    module of ``modules`` (torch checks a ``P2POp``'s op by identity against its own
    namespace), in place while any rank patches it (or ``hold`` holds it)."""
    key, original = _install(modules, name)
    mine = slot("patches", dict)
    before = mine.get(key)
    mine[key] = make(before or original)  # nested: over the outer patch
    try:
        yield
    finally:
        if before is None:
            del mine[key]
        else:
            mine[key] = before
        _release(modules, key)


def _dispatcher(key: tuple[int, str], original: Callable) -> Callable:
    @functools.wraps(original)
    def dispatch(*args, **kwargs):
        return slot("patches", dict).get(key, original)(*args, **kwargs)

    return dispatch
