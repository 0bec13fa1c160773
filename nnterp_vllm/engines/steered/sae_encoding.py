"""The SAEs a steered engine holds, on its device: placed as the model loads (before vLLM profiles memory, sized by
the memory model), and their features encoded in bounded parts into one preallocated buffer.

Two users: a capture asking for an SAE's features (encoded after the step from the block's kept rows, on the rank
that keeps rows) and a `Clamp` of a TopK SAE's feature (whose activation depends on all of that SAE's features:
computed inside the forward, at the SAE's block, for the tokens that clamp it, `steering_table`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ...specs.saes import SAE
from .memory import Ledger


class DeviceSAE(torch.nn.Module):
    """An SAE's encoder on the engine's device (the memory model's ``SAE <name> ...`` buffers): what SAELens's
    encoder computes, ``pre = ((x - b_dec) @ W_enc + b_enc) * decoder_norms`` (the subtraction where the SAE applies
    ``b_dec`` to its input, the norms a TopK SAE's that rescales by them), and its activation."""

    def __init__(self, sae: SAE, ledger: Ledger) -> None:
        super().__init__()
        self.name, self.layer, self.architecture, self.k = sae.name, sae.layer, sae.architecture, sae.k
        norms = sae.decoder_norms() if sae.rescale_acts_by_decoder_norm else torch.ones(sae.d_sae)
        held = {
            "W_enc": sae.W_enc,
            "b_enc": sae.b_enc,
            "b_dec": sae.b_dec * sae.apply_b_dec_to_input,
            "threshold": sae.threshold,
            "decoder_norms": norms,
        }
        for name, value in held.items():
            if f"SAE {sae.name} {name}" in ledger:
                tensor = ledger.allocate(f"SAE {sae.name} {name}", fill=None)
                tensor.copy_(value)
                self.register_buffer(name, tensor, False)

    @property
    def d_sae(self) -> int:
        """How many features it has."""
        return self.W_enc.shape[1]

    def pre_activation(self, stream: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``stream`` ``[rows, hidden]``'s pre-activations ``[rows, d_sae]`` (float32), into ``out`` where given."""
        pre = torch.matmul(stream.float() - self.b_dec, self.W_enc, out=out)
        pre += self.b_enc
        if self.architecture == "topk":
            pre *= self.decoder_norms
        return pre

    def activate(self, pre: torch.Tensor) -> torch.Tensor:
        """The features of pre-activations ``pre``, in place: ReLU, JumpReLU (zero up to the threshold) or TopK
        (the ``k`` largest, ReLU'd; zero elsewhere), as SAELens's ``encode``."""
        if self.architecture == "topk":
            top = pre.topk(self.k, dim=-1, sorted=False)
            return pre.zero_().scatter_(-1, top.indices, top.values.relu())
        if self.architecture == "jumprelu":
            return pre.mul_(pre > self.threshold).relu_()
        return pre.relu_()

    def encoded(self, rows: torch.Tensor, buffer: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """``rows`` ``[kept, hidden]`` (on any device) encoded part by part into ``buffer`` (the memory model's
        ``SAE encoding``): each part's first row and its features ``[part, d_sae]`` (a view of ``buffer``, valid
        until the next part)."""
        flat = buffer.view(-1)
        part = max(1, flat.numel() // self.d_sae)
        for start in range(0, rows.shape[0], part):
            chunk = rows[start : start + part].to(buffer.device, non_blocking=True)
            out = flat[: chunk.shape[0] * self.d_sae].view(chunk.shape[0], self.d_sae)
            yield start, self.activate(self.pre_activation(chunk, out))


def place_saes(saes: list[SAE], ledger: Ledger) -> tuple[dict[int, DeviceSAE], torch.Tensor | None]:
    """The SAEs whose encoders the memory model places on this rank (``ledger``), on its device, by the block they
    read, and the buffer their features are encoded into (``None`` where none is placed)."""
    placed = {sae.layer: DeviceSAE(sae, ledger) for sae in saes if f"SAE {sae.name} W_enc" in ledger}
    return placed, ledger.allocate("SAE encoding", fill=None) if "SAE encoding" in ledger else None


__all__ = ["DeviceSAE", "place_saes"]
