"""`SaeFeatures`: the features of the SAE a model holds at a block, read from and written into its ``layer_output``.

A model built with ``saes=[...]`` holds at most one SAE per block, the one reading the stream leaving it (the root
knows them: ``model.saes``). Reading ``model.layers[i].sae_features`` is that SAE's ``encode`` of the block's
``layer_output``; writing ``new`` there changes ``layer_output`` by ``(new - old) @ sae.decoder_rows()``, so a
re-encode reads ``new`` back where the SAE reconstructs the stream exactly. The value is located, selected and
put back through the block's own ``layer_output`` descriptor, so it serves on every family and engine that serves
``layer_output``, with its shape (``[batch, seq, d_sae]``; ``[1, seq, d_sae]`` per invoke on vLLM).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch
from nnsight.intervention.envoy import Envoy

from .values import NNSIGHT_ONLY, Value


class SAE(Protocol):
    """What the value needs of an SAE (`nnterp_vllm.SAE` is one): its encoder and its decoder's rows, on a device."""

    def on(self, device: torch.device) -> SAE: ...

    def encode(self, stream: torch.Tensor) -> torch.Tensor: ...

    def decoder_rows(self) -> torch.Tensor: ...


#: Why a block serves no SAE features.
NO_SAE = (
    "no SAE reads this block's output: build the model with saes=[...] (a SAELens SAE directory whose hook is "
    "this block's output, e.g. blocks.<i>.hook_resid_post, or a loaded nnterp_vllm.SAE)"
)


def held_sae(block: Envoy) -> SAE | None:
    """The SAE the model of ``block`` holds at that block (built with ``saes=[...]``), or ``None``.

    The block's index is the last segment of its path; the model is the root of its envoy tree.
    """
    index = block.path.rpartition(".")[2]
    if not index.isdigit():
        return None
    held = getattr(block.root, "saes", None)
    at = getattr(held, "at", None)
    return at(int(index)) if callable(at) else None


class Encoded(NamedTuple):
    """The selection `SaeFeatures` reads and writes by: the block's stream value (its ``layer_output``
    descriptor) with that value's own selection, the SAE encoding it, and the block."""

    stream: Value
    select: Any
    sae: SAE
    block: Envoy


class SaeFeatures(Value):
    """The features of the SAE the model holds at this block, encoded from the block's ``stream`` value.

    Read: ``sae.encode(stream)`` (float32, ``[..., d_sae]``). Written (assigned, or a read copy edited in
    place): the stream becomes ``stream + (new - old) @ sae.decoder_rows()``. Unavailable where the model holds
    no SAE at the block, or where the block does not serve its ``stream``.
    """

    writes_back = True

    def __init__(self, stream: str = "layer_output", *, description: str = "") -> None:
        super().__init__(description=description)
        self.stream = stream

    def stream_of(self, block: Envoy) -> Value:
        """The descriptor of the stream value the features are encoded from, on ``block``'s class."""
        return getattr(type(block), self.stream)

    def reason(self, block: Envoy) -> str | None:
        if held_sae(block) is None:
            return NO_SAE
        return self.stream_of(block).reason(block)

    def flat_part(self, block: Envoy) -> str:
        return NNSIGHT_ONLY

    def locate(self, block: Envoy) -> tuple[str, str]:
        return self.stream_of(block).locate(block)

    def selection(self, block: Envoy) -> Encoded:
        stream = self.stream_of(block)
        return Encoded(stream, stream.selection(block), held_sae(block), block)

    def pick(self, attribute: str, raw: Any, select: Encoded) -> torch.Tensor:
        stream = _stream(attribute, raw, select)
        return select.sae.on(stream.device).encode(stream)

    def put(self, attribute: str, current: Any, part: torch.Tensor, select: Encoded) -> Any:
        stream = _stream(attribute, current, select)
        sae = select.sae.on(stream.device)
        old = sae.encode(stream)
        if torch.equal(part, old):
            return current
        changed = stream.float() + (part.float() - old) @ sae.decoder_rows()
        written = select.stream.accept(select.block, changed.to(stream.dtype))
        return select.stream.put(attribute, current, written, select.select)


def _stream(attribute: str, raw: Any, select: Encoded) -> torch.Tensor:
    """The block's stream as its value serves it, from the served ``raw`` value."""
    return select.stream.serve(select.block, select.stream.pick(attribute, raw, select.select))
