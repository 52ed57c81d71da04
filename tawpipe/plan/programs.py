"""The small programs that run on the executor besides an iteration (design §4.1): the setup
CHECK, the gather of every master, and a validation pass. Each is every rank's list of actions of
the op table, so the engine runs them on its own channels and a recording backend sees their
traffic like the iteration's."""

from __future__ import annotations

from .actions import Action, Op, state_buf
from .plan import EVAL_BYTES, Plan


def setup_program(plan: Plan, fingerprint_bytes: int) -> tuple[tuple[Action, ...], ...]:
    """Every rank's actions before the first step: one CHECK of the ranks' fingerprints. It has the
    same shape whatever the ranks' configurations are, so comparing them cannot hang."""
    everyone = tuple(range(plan.topology.world_size))
    return tuple((Action(-1, r, Op.CHECK, group=everyone, bytes=fingerprint_bytes),) for r in everyone)


def gather_program(plan: Plan, root: int = 0) -> tuple[tuple[Action, ...], ...]:
    """Every rank's actions that gather all float32 masters on ``root`` (``full_state_dict``);
    chunk k lands in its own buffer ``state{k}``, in model order."""
    n = plan.topology.world_size
    lists: list[list[Action]] = [[] for _ in range(n)]
    for k in plan.model_order:  # every owner sends once: tag 0
        o, nbytes = plan.owner[k], plan.chunk_numel(k) * 4
        if o != root:
            lists[o].append(Action(0, o, Op.SEND_MASTER, chunk=k, peer=root, bytes=nbytes, tag=0))
            lists[root].append(Action(0, root, Op.RECV_MASTER, chunk=k, peer=o, buf=state_buf(k), bytes=nbytes,
                                      tag=0))
    return tuple(tuple(acts) for acts in lists)


def eval_program(plan: Plan, buf: str) -> tuple[tuple[Action, ...], ...]:
    """Every rank's actions of one validation pass (``TawPipe.evaluate``): in model order, each
    chunk's owner casts its master into ``buf`` (an idle weight staging buffer between steps) and
    broadcasts it to every rank, which runs its own batches through the chunk; then the loss sums
    are all-reduced. One world broadcast per chunk, no gradients."""
    n = plan.topology.world_size
    everyone = tuple(range(n))
    lists: list[list[Action]] = [[] for _ in range(n)]
    for slot, k in enumerate(plan.model_order):
        o, nbytes = plan.owner[k], plan.message_bytes(Op.BCAST_W, k)
        lists[o].append(Action(slot, o, Op.LOAD_W, chunk=k, buf=buf))
        for r in everyone:
            if n > 1:
                lists[r].append(Action(slot, r, Op.BCAST_W, chunk=k, root=o, group=everyone, buf=buf, bytes=nbytes))
            lists[r].append(Action(slot, r, Op.EVAL_F, chunk=k, buf=buf))
    for r in everyone:
        lists[r].append(Action(len(plan.model_order), r, Op.ALLREDUCE_EVAL, group=everyone, bytes=EVAL_BYTES))
    return tuple(tuple(acts) for acts in lists)
