"""Sparse autoencoders: a SAELens SAE read from its directory, its features computed as SAELens computes them.

`SAE.load` reads what SAELens's ``save_model`` writes (``cfg.json`` and ``sae_weights.safetensors``) without
running any code in it, and knows the block the SAE reads: ``blocks.k.hook_resid_post`` (or a block's own module
path, ``model.layers.k``) is the stream leaving block ``k``, ``blocks.k.hook_resid_pre`` the stream leaving block
``k - 1``. Its features are ``model.layers[k].sae_features`` on a model built with ``saes=[...]``, and a `Clamp`
sets one of them where that stream leaves the block, where `Steering` adds.

`SAE.encode` is SAELens's own rule for each architecture it serves: ``pre = (x - b_dec) @ W_enc + b_enc`` (``x``
as is where ``apply_b_dec_to_input`` is false), then ``relu(pre)`` (standard), ``relu(pre) * (pre > threshold)``
(JumpReLU), or ``relu`` of the ``k`` largest of ``pre`` and zero elsewhere (TopK; ``pre`` first times each decoder
row's norm where ``rescale_acts_by_decoder_norm``). Input normalisations and ``hook_z`` reshaping are refused
when the SAE is loaded, naming what is served.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

WHAT = "SAE"
#: The SAELens architectures whose encoder is served.
ARCHITECTURES = ("standard", "jumprelu", "topk")
#: SAELens hook names that are a block's residual stream, and the offset from the hook's index to the block whose
#: output the stream is.
SAE_HOOKS = (
    (re.compile(r"^blocks\.(\d+)\.hook_resid_post$"), 0),
    (re.compile(r"^blocks\.(\d+)\.hook_resid_pre$"), -1),
    (re.compile(r"^(?:[A-Za-z_][\w.]*\.)?(?:layers|h|blocks|layer)\.(\d+)$"), 0),
)
CONFIG_FILE, WEIGHTS_FILE = "cfg.json", "sae_weights.safetensors"


def sae_layer(hook: str) -> int | None:
    """The block whose output a SAE hooked at ``hook`` reads (``None`` for a hook that is no block's stream)."""
    for pattern, offset in SAE_HOOKS:
        match = pattern.fullmatch(hook)
        if match is not None and int(match.group(1)) + offset >= 0:
            return int(match.group(1)) + offset
    return None


def read_config(path: Path, what: str = WHAT) -> tuple[dict[str, Any], str, int]:
    """A SAELens directory's config, hook name and the block whose output it reads; ``ValueError`` naming the
    file and field that are wrong."""
    config_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
    for needed in (config_path, weights_path):
        if not needed.is_file():
            raise ValueError(f"{what}: {path} is no SAELens SAE directory: it has no {needed.name}")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as error:
        raise ValueError(f"{what}: {config_path} is not JSON: {error}") from None
    hook = (config.get("metadata") or {}).get("hook_name") or config.get("hook_name")
    if not isinstance(hook, str):
        raise ValueError(f"{what}: {config_path} names no hook_name")
    layer = sae_layer(hook)
    if layer is None:
        raise ValueError(
            f"{what}: {config_path}: hook_name {hook!r} is not a block's residual stream "
            "(blocks.<i>.hook_resid_post, blocks.<i>.hook_resid_pre with i >= 1, or a block's module path such as "
            "model.layers.<i>)"
        )
    return config, hook, layer


@dataclass(frozen=True, eq=False)
class SAE:
    """A SAELens sparse autoencoder at the block whose output it reads (`SAE.load` reads one).

    ``W_enc`` is ``[hidden, d_sae]``, ``W_dec`` ``[d_sae, hidden]``; ``threshold`` is the JumpReLU's, ``k`` the
    TopK's. ``digest`` names the weights and config (two SAEs with the same digest compute the same features);
    ``name`` is how a server or a selector names it (the directory's name unless told).
    """

    name: str
    path: str
    hook: str
    layer: int
    architecture: str
    W_enc: torch.Tensor = field(repr=False)
    b_enc: torch.Tensor = field(repr=False)
    W_dec: torch.Tensor = field(repr=False)
    b_dec: torch.Tensor = field(repr=False)
    threshold: torch.Tensor | None = field(default=None, repr=False)
    k: int | None = None
    rescale_acts_by_decoder_norm: bool = False
    apply_b_dec_to_input: bool = True
    digest: str = field(default="", repr=False)

    @classmethod
    def load(cls, path: str | os.PathLike, name: str | None = None) -> SAE:
        """The SAE SAELens saved in the directory ``path`` (``save_model``'s ``cfg.json`` and
        ``sae_weights.safetensors``), in float32 on the CPU. Raises ``ValueError`` naming the file and field when
        the directory is no SAE served here (a missing file or tensor, an architecture or input normalisation
        other than those served, shapes that disagree)."""
        from safetensors import safe_open

        if not isinstance(path, str | os.PathLike):
            raise TypeError(f"{WHAT}.load: path must be a SAELens SAE directory, not {type(path).__name__}")
        directory = Path(path)
        if not directory.is_dir():
            raise ValueError(f"{WHAT}.load: {directory} is not a directory (a SAELens SAE directory is)")
        config, hook, layer = read_config(directory)
        where = directory / CONFIG_FILE
        architecture = config.get("architecture", "standard")
        if architecture not in ARCHITECTURES:
            raise ValueError(
                f"{WHAT}.load: {where}: architecture {architecture!r} is not served; served: {', '.join(ARCHITECTURES)}"
            )
        for key, served in (("normalize_activations", "none"), ("reshape_activations", "none")):
            if config.get(key, served) != served:
                raise ValueError(
                    f"{WHAT}.load: {where}: {key} is {config[key]!r}; only SAEs with {key}={served!r} are served "
                    "(fold the normalisation into the weights first, as SAELens's fold methods do)"
                )
        names = ["W_enc", "b_enc", "W_dec", "b_dec"] + (["threshold"] if architecture == "jumprelu" else [])
        weights_path = directory / WEIGHTS_FILE
        try:
            with safe_open(weights_path, "pt") as handle:
                held = set(handle.keys())
                missing = [tensor for tensor in names if tensor not in held]
                if missing:
                    raise ValueError(f"{WHAT}.load: {weights_path} has no {', '.join(missing)} tensor")
                tensors = {tensor: handle.get_tensor(tensor).to(torch.float32) for tensor in names}
        except ValueError:
            raise
        except Exception as error:  # noqa: BLE001 - safetensors raises several kinds on a damaged file
            raise ValueError(f"{WHAT}.load: {weights_path} is not a readable safetensors file: {error}") from None
        hidden, d_sae = tensors["W_enc"].shape if tensors["W_enc"].dim() == 2 else (None, None)
        expected = {"W_enc": (hidden, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, hidden), "b_dec": (hidden,)}
        expected["threshold"] = (d_sae,)
        for tensor, value in tensors.items():
            if hidden is None or tuple(value.shape) != expected[tensor]:
                raise ValueError(
                    f"{WHAT}.load: {weights_path}: {tensor} has shape {list(value.shape)}; W_enc [d_in, d_sae] sets "
                    f"the others: {tensor} {list(expected[tensor]) if hidden is not None else '?'}"
                )
        k = config.get("k") if architecture == "topk" else None
        if architecture == "topk" and (not isinstance(k, int) or isinstance(k, bool) or not 0 < k <= d_sae):
            raise ValueError(f"{WHAT}.load: {where}: a TopK SAE's k must be an int in 1..{d_sae}, got {k!r}")
        digest = hashlib.sha256(weights_path.read_bytes() + json.dumps(config, sort_keys=True).encode()).hexdigest()
        return cls(
            name=name or directory.name,
            path=str(directory),
            hook=hook,
            layer=layer,
            architecture=architecture,
            W_enc=tensors["W_enc"],
            b_enc=tensors["b_enc"],
            W_dec=tensors["W_dec"],
            b_dec=tensors["b_dec"],
            threshold=tensors.get("threshold"),
            k=k,
            rescale_acts_by_decoder_norm=bool(config.get("rescale_acts_by_decoder_norm", False)),
            apply_b_dec_to_input=bool(config.get("apply_b_dec_to_input", True)),
            digest=digest,
        )

    @property
    def d_sae(self) -> int:
        """How many features it has."""
        return self.W_enc.shape[1]

    @property
    def d_in(self) -> int:
        """The width of the stream it reads."""
        return self.W_enc.shape[0]

    def _weights(self, name: str, like: torch.Tensor) -> torch.Tensor:
        return getattr(self, name).to(like.device)

    def on(self, device: Any) -> SAE:
        """This SAE with its weights on ``device`` (itself where they are there already; a moved copy is kept)."""
        device = torch.device(device)
        if self.W_enc.device == device:
            return self
        moved = self.__dict__.get("_moved")
        if moved is None or moved.W_enc.device != device:
            tensors = {name: getattr(self, name) for name in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold")}
            moved = dataclasses.replace(
                self, **{name: None if t is None else t.to(device) for name, t in tensors.items()}
            )
            object.__setattr__(self, "_moved", moved)
        return moved

    def pre_activation(self, stream: torch.Tensor) -> torch.Tensor:
        """``[..., d_sae]``: what SAELens's encoder computes before its activation (float32)."""
        stream = stream.float()
        if self.apply_b_dec_to_input:
            stream = stream - self._weights("b_dec", stream)
        pre = stream @ self._weights("W_enc", stream) + self._weights("b_enc", stream)
        if self.architecture == "topk" and self.rescale_acts_by_decoder_norm:
            pre = pre * self.decoder_norms().to(pre.device)
        return pre

    def feature_encoder(self, feature: int) -> tuple[torch.Tensor, float, float]:
        """Feature ``feature``'s encoder as one direction: ``(read, offset, threshold)`` with its pre-activation
        ``stream . read + offset`` and its activation that pre-activation where it exceeds ``threshold`` (the
        ReLU's zero, or a JumpReLU's threshold where that is higher), else zero. A TopK SAE's feature is also
        zero outside the ``k`` largest, which one direction cannot say."""
        read = self.W_enc[:, feature].clone()
        offset = self.b_enc[feature]
        if self.apply_b_dec_to_input:
            offset = offset - self.b_dec @ read
        if self.architecture == "topk" and self.rescale_acts_by_decoder_norm:
            norm = self.decoder_norms()[feature]
            read, offset = read * norm, offset * norm
        threshold = 0.0
        if self.architecture == "jumprelu":
            threshold = max(0.0, float(self.threshold[feature]))
        return read, float(offset), threshold

    def decoder_norms(self) -> torch.Tensor:
        """``[d_sae]``: each decoder row's norm."""
        return self.W_dec.norm(dim=-1)

    def encode(self, stream: torch.Tensor) -> torch.Tensor:
        """The features of ``stream`` (``[..., d_in]``): ``[..., d_sae]``, float32, as SAELens's ``encode``."""
        pre = self.pre_activation(stream)
        if self.architecture == "jumprelu":
            return pre.relu() * (pre > self._weights("threshold", pre))
        if self.architecture == "topk":
            top = pre.topk(self.k, dim=-1, sorted=False)
            return torch.zeros_like(pre).scatter_(-1, top.indices, top.values.relu())
        return pre.relu()

    def decoder_rows(self) -> torch.Tensor:
        """``[d_sae, d_in]``: what one unit of each feature adds to the reconstruction (the decoder row, over its
        norm for a TopK SAE that rescales its activations by it)."""
        if self.architecture == "topk" and self.rescale_acts_by_decoder_norm:
            return self.W_dec / self.decoder_norms()[:, None]
        return self.W_dec

    def decode(self, features: torch.Tensor) -> torch.Tensor:
        """The reconstruction of ``features`` (``[..., d_sae]``): ``[..., d_in]``, float32, as SAELens's
        ``decode``."""
        features = features.float()
        return features @ self.decoder_rows().to(features.device) + self._weights("b_dec", features)


def as_sae(sae: Any, what: str = WHAT) -> SAE:
    """``sae`` (a loaded `SAE` or the path of a SAELens directory) as a loaded `SAE`."""
    if isinstance(sae, SAE):
        return sae
    if isinstance(sae, str | os.PathLike):
        return SAE.load(sae)
    raise TypeError(f"{what}: an SAE is a loaded nnterp_vllm.SAE or a SAELens SAE directory, not {type(sae).__name__}")


def sae_list(saes: Any, num_layers: int | None = None, hidden_size: int | None = None) -> list[SAE]:
    """``saes=[...]`` as given to a model or engine (paths or loaded `SAE`), loaded and checked against the model:
    one SAE per block, each reading a block the model has, of its width, names distinct. ``ValueError``."""
    if saes is None:
        return []
    if isinstance(saes, SAE | str | os.PathLike):
        saes = [saes]
    if not isinstance(saes, list | tuple):
        raise TypeError(f"saes: a list of SAEs (loaded nnterp_vllm.SAE or SAELens directories), not {type(saes)}")
    loaded = [as_sae(sae, f"saes[{index}]") for index, sae in enumerate(saes)]
    for field_name in ("layer", "name"):
        seen: dict[Any, str] = {}
        for sae in loaded:
            key = getattr(sae, field_name)
            if key in seen:
                raise ValueError(
                    f"saes: {sae.path} and {seen[key]} share the {field_name} {key!r}; a model holds one SAE per "
                    "block, each under its own name"
                )
            seen[key] = sae.path
    for sae in loaded:
        if num_layers is not None and sae.layer >= num_layers:
            raise ValueError(
                f"saes: {sae.path} reads the output of block {sae.layer} (hook {sae.hook}); the model has "
                f"{num_layers} blocks (0..{num_layers - 1})"
            )
        if hidden_size is not None and sae.d_in != hidden_size:
            raise ValueError(
                f"saes: {sae.path} reads a stream of width {sae.d_in}; this model's residual stream is {hidden_size} "
                "wide: the SAE was trained on another model"
            )
    return loaded


__all__ = ["ARCHITECTURES", "SAE", "as_sae", "read_config", "sae_layer", "sae_list"]
