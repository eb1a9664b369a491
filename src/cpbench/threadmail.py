"""The threaded group's mailbox at a case's edges (``cpbench.threadpg``, ``--launcher
threads``): a run keeps its process groups from case to case, so a message one case left
behind could be taken by the next case's receive of the same peer and tag. Messages are keyed
by the case; ``begin_case`` starts a rank's next case, ``end_case`` fails a case that left
mail undelivered or a receive never completed (NCCL would let either corrupt the next case).
Both do nothing outside a threaded launch."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from cpbench import threadpg


class MailLeft(RuntimeError):
    """A case ended with mail undelivered: its failure, not the process group's (every rank
    reached the case's end, so the group stays usable)."""


def begin_case() -> None:
    """This rank starts a case: its messages from now on are the case's own; mail to it
    left from an earlier case, which no receive can match now, is dropped."""
    if not threadpg.threaded():
        return
    threadpg.set_case(threadpg.case() + 1)
    mine = _groups()
    world = threadpg.current_world()
    with world.cond:
        for key in [k for k in world.mail if k[4] < threadpg.case() and _to_me(k, mine)]:
            del world.mail[key]


def end_case() -> None:
    """This rank ends a case (collective: every rank of the world calls it). Once every rank
    has sent all it will, raises ``MailLeft`` for mail to this rank that no receive took and
    for receives it posted and never waited for."""
    if not threadpg.threaded():
        return
    dist.barrier()  # every send of the case is in the mailbox
    mine, world, now = _groups(), threadpg.current_world(), threadpg.case()
    with world.cond:
        left = [k for k in world.mail if k[4] == now and _to_me(k, mine)]
    problems = [f"message {n + 1} from rank {mine[pg].global_rank(src)} (tag {tag}, on ranks "
                f"{mine[pg].members()}) never received" for pg, src, _, tag, _, n in left]
    for group in mine.values():
        problems += [f"receive from rank {group.global_rank(w.key[1])} (tag {w.key[3]}) "
                     f"never waited for" for w in group.waiting if w.key[4] == now]
        group.waiting.clear()
    if problems:
        raise MailLeft(
            f"rank {dist.get_rank()}: mail left at the case's end: {'; '.join(problems[:3])}"
            + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""))


def _groups() -> dict[str, threadpg.ThreadedGroup]:
    """This rank thread's threaded groups (its world's and every subgroup's), by name."""
    return {g.pg_name: g for g in c10d._world.pg_map if isinstance(g, threadpg.ThreadedGroup)}


def _to_me(key: tuple, mine: dict[str, threadpg.ThreadedGroup]) -> bool:
    """Whether mail ``key`` (group name, sender, receiver in that group, …) is to this rank."""
    group = mine.get(key[0])
    return group is not None and group.rank() == key[2]
