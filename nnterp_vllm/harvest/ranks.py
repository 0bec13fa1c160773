"""A transformers harvest under tensor parallelism (``torchrun``, one process per rank): every rank runs every
forward (each holds a shard of the weights and takes part in its collectives), rank 0 alone plans, resumes and
writes. Rank 0 hands each other rank the unit it is about to compute; the others compute it and drop the values
(every value is whole on every rank)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from .store import HarvestError

#: What rank 0 sends when it has nothing more to compute: whether the harvest finished.
_END = "end"


def sharded_transformers(model: Any, engine: str, model_kwargs: dict[str, Any] | None) -> bool:
    """Whether a harvest of ``model`` on ``engine`` runs under transformers tensor parallelism: a model passed in
    that transformers split across ranks, or a checkpoint whose loading arguments ask for more than one rank."""
    if engine != "transformers":
        return False
    if not isinstance(model, str | os.PathLike):
        from nnsight.modeling.tp import device_mesh

        return device_mesh(model) is not None
    from ..engines.tensor_parallel import as_distributed_config, transformers_degree

    kwargs = dict(model_kwargs or {})
    as_distributed_config(kwargs)
    return transformers_degree(kwargs) > 1


def rank() -> int:
    """This process's rank among the launcher's (0 when there is none)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def _exchange(item: Any = None) -> Any:
    """Rank 0's ``item``, on every rank."""
    import torch.distributed as dist

    box = [item]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Leader:
    """Rank 0's side: `send` each unit before computing it; leaving the block tells the others it is over."""

    def send(self, unit: Any, job: Any) -> None:
        _exchange((unit, job))


@contextlib.contextmanager
def lead(sharded: bool) -> Iterator[Leader | None]:
    """On rank 0 of a sharded harvest, a `Leader` whose exit ends the other ranks' `follow` (``None`` otherwise)."""
    if not sharded:
        yield None
        return
    finished = False
    try:
        yield Leader()
        finished = True
    finally:
        _exchange((_END, finished))


def follow(model: Any, compute: Any) -> None:
    """On a rank other than 0: compute each unit rank 0 sends with ``compute(model, unit, job)`` until it ends;
    HarvestError if rank 0 stopped short of finishing."""
    while True:
        unit, job = _exchange()
        if unit == _END:
            if not job:
                raise HarvestError("rank 0, which writes this harvest, stopped before finishing: see its error")
            return
        compute(model, unit, job)
