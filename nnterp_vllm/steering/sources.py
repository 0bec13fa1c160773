"""Steering vectors made elsewhere, as `Steering` specs: repeng's control vectors, steering-vectors' vectors, an
SAE's decoder rows, and contrast vectors computed from our own harvest.

Each source carries one vector per layer (`read_vectors`); `load_steering` makes one `Steering` per layer, at the
layer the source's own library applies it, with its sign. What each library does, and so what its import here keeps:

- repeng (``ControlVector``, or its ``export_gguf`` file: GGUF architecture ``controlvector``, tensors
  ``direction.{layer}``): ``ControlModel`` adds ``coeff * direction[k]`` to the output of ``model.layers[k]`` at
  every non-padding token: ``Steering(k, direction, factor=coeff)``. repeng 0.4 trains ``direction[k]`` from
  ``hidden_states[k + 1]``, block ``k``'s output (its layer ids made non-negative first), so a vector is applied
  where it was read. A negative key (a vector made by hand) counts from the last block, as `Steering` does.
- steering-vectors (``SteeringVector``, or its dict saved by ``torch.save`` or as safetensors: tensors
  ``layer_activations.{layer}``, metadata ``layer_type``): ``apply(model, multiplier)`` adds ``multiplier *
  layer_activations[k]`` to the output of the ``k``-th decoder block: ``Steering(k, vector, factor=multiplier)``.
  Its other layer types (attention, MLP, norms) are not a block's output and are refused.
- SAELens (a directory with ``cfg.json`` and ``sae_weights.safetensors``): feature ``i``'s decoder row
  ``W_dec[i]``, added where the SAE reads: ``blocks.k.hook_resid_post`` or a block's own module path
  (``model.layers.k``) is block ``k``'s output; ``blocks.k.hook_resid_pre`` is block ``k - 1``'s.

Files are read without running any code in them (``torch.load(..., weights_only=True)``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..specs.saes import WEIGHTS_FILE, read_config
from ..specs.steering import Steering, check_scale

WHAT = "load_steering"


def load_steering(
    source: Any,
    factor: float = 1.0,
    positions: str | Sequence[int] = "all",
    feature: int | None = None,
    layers: int | Sequence[int] | None = None,
    scale: str = "absolute",
) -> list[Steering]:
    """One `Steering` per layer a vector made elsewhere carries, adding it times ``factor`` at ``positions``, where
    and as its own library applies it (`read_vectors`): a repeng ``ControlVector`` or its ``.gguf`` file, a
    steering-vectors ``SteeringVector`` or its saved dict, a SAELens SAE directory (``feature``: the feature whose
    decoder row is the vector). ``layers`` keeps only those of the source's layers (numbered as the source numbers
    them). ``scale="relative"`` makes ``factor`` a fraction of the stream's norm at each layer (`Steering`'s
    ``scale``: only each vector's direction counts). Raises ValueError naming the file and the field of a malformed
    source."""
    vectors = read_vectors(source, feature)
    if layers is not None:
        chosen = [layers] if isinstance(layers, int) else list(layers)
        missing = sorted(set(chosen) - set(vectors))
        if missing:
            raise ValueError(
                f"{WHAT}: {describe(source)} carries layers {sorted(vectors)}, not {missing}; choose among them"
            )
        vectors = {layer: vectors[layer] for layer in chosen}
    return [
        Steering(layer, vector, factor=factor, positions=positions, scale=scale)
        for layer, vector in sorted(vectors.items())
    ]


def read_vectors(source: Any, feature: int | None = None) -> dict[int, torch.Tensor]:
    """``{layer: vector}`` of any source `load_steering` takes (float32, on the CPU): a repeng ``ControlVector`` or
    its ``.gguf`` file; a steering-vectors ``SteeringVector`` or its dict saved with ``torch.save`` or as
    safetensors; a SAELens SAE directory (``feature``: the SAE feature whose decoder row is the vector). Raises
    ValueError naming the file and the field when a source is malformed or is none of these."""
    if hasattr(source, "directions") and hasattr(source, "model_type"):  # repeng's ControlVector
        return _per_layer(source.directions, describe(source), "directions")
    if hasattr(source, "layer_activations") and hasattr(source, "layer_type"):  # steering-vectors' SteeringVector
        return _steering_vectors_dict(vars(source), describe(source))
    if not isinstance(source, str | os.PathLike):
        raise TypeError(
            f"{WHAT}: a source is a repeng ControlVector, a steering-vectors SteeringVector, or a path to one of "
            f"their files or to a SAELens SAE directory, not {type(source).__name__}"
        )
    path = Path(source)
    if path.is_dir():
        return _sae_decoder_row(path, feature)
    if not path.is_file():
        raise ValueError(f"{WHAT}: {path} does not exist")
    if feature is not None:
        raise ValueError(f"{WHAT}: feature= picks a SAE's decoder row; {path} is a file, not a SAELens directory")
    with open(path, "rb") as handle:
        head = handle.read(9)
    if head[:4] == b"GGUF":
        return _control_vector_gguf(path)
    if len(head) == 9 and head[8:9] == b"{":  # safetensors: an 8-byte header length, then the JSON header
        return _steering_vectors_safetensors(path)
    return _steering_vectors_saved(path)


def describe(source: Any) -> str:
    return str(source) if isinstance(source, str | os.PathLike) else f"the {type(source).__name__}"


def _per_layer(vectors: Any, where: str, field: str) -> dict[int, torch.Tensor]:
    if not isinstance(vectors, dict) or not vectors:
        raise ValueError(f"{WHAT}: {where}: {field} must map layers to vectors, got {type(vectors).__name__}")
    found = {}
    for layer, vector in vectors.items():
        layer_number = int(layer) if isinstance(layer, str) and re.fullmatch(r"-?\d+", layer) else layer
        if not isinstance(layer_number, int) or isinstance(layer_number, bool):
            raise ValueError(f"{WHAT}: {where}: {field} has the key {layer!r}, which is no layer number")
        tensor = torch.as_tensor(vector)
        if tensor.dim() != 1 or not tensor.is_floating_point():
            raise ValueError(
                f"{WHAT}: {where}: {field}[{layer!r}] must be a 1-d floating vector, got {tensor.dtype} "
                f"of shape {list(tensor.shape)}"
            )
        found[layer_number] = tensor.detach().to("cpu", torch.float32)
    return found


def _control_vector_gguf(path: Path) -> dict[int, torch.Tensor]:
    """repeng's ``export_gguf`` file."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as error:  # noqa: BLE001 - gguf raises many kinds on a damaged file
        raise ValueError(f"{WHAT}: {path} is not a readable GGUF file: {error}") from None
    arch = reader.get_field("general.architecture")
    name = str(bytes(arch.parts[-1]), "utf-8", "replace") if arch is not None and arch.parts else None
    if name != "controlvector":
        raise ValueError(
            f"{WHAT}: {path}: general.architecture is {name!r}; a repeng control vector's is 'controlvector'"
        )
    vectors = {}
    for tensor in reader.tensors:
        match = re.fullmatch(r"direction\.(-?\d+)", tensor.name)
        if match is None:
            raise ValueError(f"{WHAT}: {path}: tensor {tensor.name!r} is not named direction.<layer>")
        vectors[int(match.group(1))] = torch.from_numpy(tensor.data.copy())
    return _per_layer(vectors, str(path), "direction tensors")


def _steering_vectors_dict(saved: Any, where: str) -> dict[int, torch.Tensor]:
    if not isinstance(saved, dict) or "layer_activations" not in saved:
        raise ValueError(
            f"{WHAT}: {where}: a steering-vectors SteeringVector saved as a dict has 'layer_activations' "
            f"(and 'layer_type'); found {sorted(saved) if isinstance(saved, dict) else type(saved).__name__}"
        )
    layer_type = saved.get("layer_type", "decoder_block")
    if layer_type != "decoder_block":
        raise ValueError(
            f"{WHAT}: {where}: layer_type is {layer_type!r}; only 'decoder_block' vectors are added to a block's "
            "output, where Steering adds"
        )
    return _per_layer(saved["layer_activations"], where, "layer_activations")


def _steering_vectors_saved(path: Path) -> dict[int, torch.Tensor]:
    """steering-vectors' dict (``layer_activations``, ``layer_type``) saved with ``torch.save``."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - pickle and zip errors of many kinds
        raise ValueError(
            f"{WHAT}: {path} is none of the formats read here (a repeng .gguf, a steering-vectors dict saved "
            f"with torch.save or as safetensors, a SAELens directory), or holds more than tensors: {error}"
        ) from None
    return _steering_vectors_dict(saved, str(path))


def _steering_vectors_safetensors(path: Path) -> dict[int, torch.Tensor]:
    """steering-vectors' vector as safetensors: tensors ``layer_activations.{layer}``, metadata ``layer_type``."""
    from safetensors import safe_open

    try:
        with safe_open(path, "pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 - not a dict
    except Exception as error:  # noqa: BLE001
        raise ValueError(f"{WHAT}: {path} is not a readable safetensors file: {error}") from None
    activations = {}
    for name, tensor in tensors.items():
        match = re.fullmatch(r"layer_activations\.(-?\d+)", name)
        if match is None:
            raise ValueError(f"{WHAT}: {path}: tensor {name!r} is not named layer_activations.<layer>")
        activations[int(match.group(1))] = tensor
    return _steering_vectors_dict({"layer_activations": activations, **metadata}, str(path))


def _sae_decoder_row(path: Path, feature: int | None) -> dict[int, torch.Tensor]:
    """Feature ``feature``'s decoder row of the SAELens SAE in ``path``, at the block its hook reads."""
    _, _, layer = read_config(path, WHAT)
    weights_path = path / WEIGHTS_FILE
    from safetensors import safe_open

    with safe_open(weights_path, "pt") as handle:
        if "W_dec" not in handle.keys():  # noqa: SIM118 - not a dict
            raise ValueError(f"{WHAT}: {weights_path} has no W_dec tensor")
        decoder = handle.get_slice("W_dec")
        features = decoder.get_shape()[0]
        if not isinstance(feature, int) or isinstance(feature, bool) or not 0 <= feature < features:
            raise ValueError(
                f"{WHAT}: {path}: feature must be an int in 0..{features - 1} (the SAE's d_sae), got {feature!r}"
            )
        row = decoder[feature : feature + 1][0]
    return _per_layer({layer: row}, str(path), "W_dec")


def pair_sign(up: torch.Tensor, down: torch.Tensor) -> int:
    """The sign that puts positive texts (projections ``up``) above their negative partners (``down``) more often
    than not (repeng's rule); where as often as not, above on average."""
    above, below = (up > down).sum(), (up < down).sum()
    if above != below:
        return 1 if above > below else -1
    return 1 if (up - down).mean() >= 0 else -1


def contrast_steering(
    model: Any,
    positive: Sequence[str],
    negative: Sequence[str],
    layers: int | Sequence[int],
    *,
    method: str = "mean",
    factor: float = 1.0,
    positions: str | Sequence[int] = "all",
    engine: str = "transformers",
    scale: str = "absolute",
) -> list[Steering]:
    """Contrast vectors from two sets of texts, one `Steering` per layer, from our own harvest of each text's
    last token's residual stream leaving the layer.

    ``method="mean"``: the mean of ``positive`` less the mean of ``negative``. ``method="pca"`` (repeng's
    ``pca_diff``, the CAA recipe): the first principal component of the paired differences ``positive[i] -
    negative[i]`` (centered), a unit vector, its sign chosen so that positive texts project above their
    negative partner more often than not (`pair_sign`).

    Args:
        model: A checkpoint or a standardized model, as `harvest` takes it (``engine`` for a checkpoint).
        positive, negative: The texts (as many of each for ``"pca"``).
        layers: The blocks whose output to take the vectors at (and to steer at).
        factor, positions, scale: Each `Steering`'s (``scale="relative"``: ``factor`` a fraction of the stream's
            norm, the vector's direction only).
    """
    import tempfile

    from ..harvest import harvest
    from ..harvest.compute import build_settings, load_model
    from ..specs.selection import check_selectors

    if method not in ("mean", "pca"):
        raise ValueError(f"contrast_steering: method must be 'mean' or 'pca', got {method!r}")
    check_scale(scale, "contrast_steering")
    for name, texts in (("positive", positive), ("negative", negative)):
        if isinstance(texts, str) or not texts or not all(isinstance(text, str) and text for text in texts):
            raise ValueError(f"contrast_steering: {name} must be a non-empty list of non-empty texts")
    if method == "pca" and len(positive) != len(negative):
        raise ValueError(
            f"contrast_steering: method='pca' pairs the texts: {len(positive)} positive, {len(negative)} negative"
        )
    chosen = [layers] if isinstance(layers, int) else list(layers)
    names = [f"layers.{layer}.layer_output" for layer in chosen]
    loaded = load_model(model, engine, build_settings(check_selectors(names, None), engine, {}))
    try:
        with tempfile.TemporaryDirectory(prefix="nnterp-contrast-") as scratch:
            kept = [
                harvest(loaded, list(texts), names, Path(scratch) / side, positions="last", progress=False)
                for side, texts in (("positive", positive), ("negative", negative))
            ]
            streams = [{name: harvested.load(name).float() for name in names} for harvested in kept]
    finally:
        if loaded is not model and loaded.ENGINE == "vllm":
            loaded.shutdown()
    specs = []
    for layer, name in zip(chosen, names):
        ups, downs = streams[0][name], streams[1][name]
        if method == "mean":
            vector = ups.mean(0) - downs.mean(0)
        else:
            differences = ups - downs
            _, _, directions = torch.linalg.svd(differences - differences.mean(0), full_matrices=False)
            vector = directions[0] * pair_sign(ups @ directions[0], downs @ directions[0])
        specs.append(Steering(layer, vector, factor=factor, positions=positions, scale=scale))
    return specs


__all__ = ["contrast_steering", "pair_sign", "read_vectors"]
