"""`Standardized`: the engine-independent root of a standardized model.

It knows the root values, the sizes, ``support()``, the loading rules shared by the
engines and the public methods (steering, skipping layers, the logit lens). It never
knows an operation name inside a forward or a family's config keys: a family function
of the same name overrides a size or ``project_on_vocab``.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import torch
from nnsight.intervention.interleaver import Mediator

from . import arguments, families
from .arguments import LayerSelection, Positions
from .components import Derived, Layers, Standard, Value, values_of
from .components.values import require_trace, writable_value
from .families._layouts import BLOCK_NORMS
from .steering.saes import SAE, sae_list

#: What ``saes=`` takes: SAELens SAE directories or loaded `SAE` (one, or a list of them), or ``None``.
SAEs = SAE | str | os.PathLike | Sequence[SAE | str | os.PathLike] | None

#: Family modules by name, for families handed in as module objects that no import can find.
_FAMILIES: dict[str, Any] = {}
#: What ``when=`` takes: ``(Probe, op, threshold)`` or ``(sae, feature, op, threshold)`` (`steering.probes.gate`).
Gate = tuple[Any, ...]
#: Each invoke's block outputs before the steering edits at them, by the invoke's worker: block index -> (visit,
#: stream), the stream the first edit (or gate read) at the block's latest visit found (`_unsteered`).
_UNSTEERED: weakref.WeakKeyDictionary[Any, dict[int, tuple[int, torch.Tensor]]] = weakref.WeakKeyDictionary()


class Size:
    """A read-only size: a family function of the same name wins, else the plain rule over the text config."""

    def __init__(self, rule: Callable[[Any], int]) -> None:
        self.rule = rule
        self.__doc__ = rule.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, model: Any, owner: Any = None) -> Any:
        if model is None:
            return self
        override = getattr(model.family, self.name, None)
        if callable(override):
            return override(model)
        return self.rule(model.config.get_text_config())

    def __set__(self, model: Any, value: Any) -> None:
        raise AttributeError(
            f"{self.name} is read-only: it is read from the model's config "
            f"(a family module spells it otherwise with `def {self.name}(model)`)"
        )


def _num_heads(config: Any) -> int:
    return config.num_attention_heads


def _first_of(*keys: str) -> Callable[[Any], int]:
    """A size rule reading the first of ``keys`` the config sets (0 when it sets none: a dense model)."""

    def rule(config: Any) -> int:
        return next((getattr(config, key) for key in keys if getattr(config, key, None)), 0)

    return rule


class Indexed:
    """``model.layers_output[i]``-style access to one value of every block, readable and writable."""

    def __init__(self, model: Standardized, name: str, child: str | None = None) -> None:
        self.model, self.name, self.child = model, name, child

    def _host(self, layer: int) -> Any:
        block = self.model.layers[layer]
        return getattr(block, self.child) if self.child else block

    def __getitem__(self, layer: int) -> Any:
        return getattr(self._host(layer), self.name)

    def __setitem__(self, layer: int, value: Any) -> None:
        setattr(self._host(layer), self.name, value)

    def __len__(self) -> int:
        return self.model.num_layers

    def print_source(self, layer: int = 0) -> None:
        """Print where this value is read on block ``layer``, as nnterp's ``print_source`` did: the forward it is
        read in, its operations named as nnsight names them (the one it is read at among them), then the whole
        module's forward; or, where the model does not serve it, the reason."""
        host = self._host(layer)
        value = type(host).values()[self.name]
        reason = value.reason(host)
        if reason:
            print(f"{host.path}.{self.name} is not served: {reason}")
            return
        explain = getattr(value, "explain", None)
        if explain is not None:  # a value the engine never materializes, rebuilt from others
            print(f"{host.path}.{self.name}: {explain(host)}")
            return
        *walk, attribute = value.path(host).split(".")
        print(f"Accessing {self.name} from {host.path}{''.join(f'.{part}' for part in walk)} ({attribute}):")
        # The forward the value is read in: the last `source` on the way there, else the module's own.
        inside = walk[: len(walk) - walk[::-1].index("source")] if "source" in walk else [*walk, "source"]
        with self.model.trace(" "):  # nnsight shows an operation's own forward inside a trace only
            node = host
            for part in inside:
                node = getattr(node, part)
            print(node)
        print(f"\n\nFull module source ({host.path}):")
        print(host.source)


class Migration:
    """An nnterp spelling, ``model.layers_output[i]``, for one value of every block (or of its ``child``)."""

    def __init__(self, value: str, child: str | None = None) -> None:
        self.value, self.child = value, child
        where = f"layers[i].{child}" if child else "layers[i]"
        self.__doc__ = f"``model.<this>[i]`` is ``model.{where}.{value}``, readable and writable."

    def __get__(self, model: Any, owner: Any = None) -> Any:
        return self if model is None else Indexed(model, self.value, self.child)


class IndexedModules(Indexed):
    """``model.attentions[i]``-style access to one module of every block; modules are not written."""

    def __getitem__(self, layer: int) -> Any:
        return getattr(self.model.layers[layer], self.name)

    def __setitem__(self, layer: int, value: Any) -> None:
        raise TypeError(
            f"layers[{layer}].{self.name} is a module, which is not written; write one of its values "
            f"(e.g. model.layers[{layer}].{self.name}.{self.child}) or its nnterp spelling"
        )


class ModuleMigration:
    """An nnterp spelling, ``model.attentions[i]``, for one module of every block (``value``: its output's name)."""

    def __init__(self, module: str, value: str) -> None:
        self.module, self.value = module, value
        self.__doc__ = f"``model.<this>[i]`` is the module ``model.layers[i].{module}``."

    def __get__(self, model: Any, owner: Any = None) -> Any:
        return self if model is None else IndexedModules(model, self.module, self.value)


#: The SAEs models of this process hold, by ``(name, digest)``: what a model pickled into an engine's worker in this
#: process finds them by (weak: a model dropped lets its SAEs go).
_HELD: weakref.WeakValueDictionary[tuple[str, str], SAE] = weakref.WeakValueDictionary()
#: The SAEs a worker in another process loaded from their directories, by ``(name, digest)``: kept for the
#: worker's later traces.
_LOADED: dict[tuple[str, str], SAE] = {}


class HeldSAEs(Mapping[str, SAE]):
    """The SAEs a model holds (built with ``saes=[...]``), by name; `at` is the one reading a block's output.

    It pickles as where each SAE was loaded from (name, directory, digest), not as its weights, so the model
    travels into vLLM's workers light: a worker in this process takes the SAEs this process holds; a worker in
    another process loads each directory once and checks it holds the SAE the client loaded (its digest).
    """

    def __init__(self, saes: Iterable[SAE] = ()) -> None:
        self._by_name = {sae.name: sae for sae in saes}
        self._by_layer = {sae.layer: sae for sae in self._by_name.values()}
        for sae in self._by_name.values():
            _HELD[sae.name, sae.digest] = sae

    def at(self, layer: int) -> SAE | None:
        """The SAE reading block ``layer``'s output, or ``None``."""
        return self._by_layer.get(layer)

    def __getitem__(self, name: str) -> SAE:
        return self._by_name[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def __repr__(self) -> str:
        return f"HeldSAEs({ {name: f'block {sae.layer}' for name, sae in self._by_name.items()} })"

    def __reduce__(self) -> tuple[Callable[..., HeldSAEs], tuple[list[tuple[str, str, str]]]]:
        return _held_saes, ([(sae.name, sae.path, sae.digest) for sae in self._by_name.values()],)


def _held_saes(entries: list[tuple[str, str, str]]) -> HeldSAEs:
    """A pickled `HeldSAEs` again: each ``(name, path, digest)`` as the SAE this process holds, else loaded from its
    directory (once per process) and checked to be the SAE the client loaded."""
    saes = []
    for name, path, digest in entries:
        sae = _HELD.get((name, digest)) or _LOADED.get((name, digest))
        if sae is None:
            sae = SAE.load(path, name)
            if sae.digest != digest:
                raise ValueError(f"saes: {path} changed on disk since the model was built with it; build it again")
            _LOADED[name, digest] = sae
        saes.append(sae)
    return HeldSAEs(saes)


class _Unbuilt:
    """What a `Size` reads of a model before it is built: its config and its family."""

    def __init__(self, config: Any, family: Any) -> None:
        self.config, self.family = config, family


def _next_token_probs(model: Standardized) -> torch.Tensor:
    return torch.softmax(model.logits[:, -1, :].float(), dim=-1)


class Standardized:
    """The root of a standardized model; mixed over an nnsight engine class (`engines/`)."""

    #: The name of the family module serving this model; set by the engine's constructor.
    _family_name: str
    #: The engine's name in ``support()`` and errors.
    ENGINE = "transformers"

    @property
    def family(self) -> Any:
        """The family module serving this model (held by name, so the model pickles into vLLM's workers)."""
        name = self._family_name
        return _FAMILIES.get(name) or sys.modules.get(name) or importlib.import_module(name)

    def _serve_with(self, family: Any) -> None:
        """Record the family serving this model (called by the engine's constructor)."""
        _FAMILIES[family.__name__] = family
        self._family_name = family.__name__

    # -- root values ----------------------------------------------------------

    logits = Value("output", select="logits", description="The model's logits [batch, seq, vocab]")
    token_embeddings = Value("embed_tokens.output", description="The token embeddings [batch, seq, hidden]")
    final_norm_output = Value("norm.output", description="The final norm's output [batch, seq, hidden]")
    lm_head_output = Value(
        "{self._unembedding_name}.output", description="The head's output, before any post-head step"
    )
    input_ids = Value("inputs", select="input_ids", description="The token ids of the batch [batch, seq]")
    attention_mask = Value("inputs", select="attention_mask", description="The attention mask [batch, seq]")
    next_token_probs = Derived(_next_token_probs, description="Softmax of the last position's logits [batch, vocab]")
    input_size = Derived(lambda model: model.input_ids.shape, description="The shape of input_ids")

    # -- sizes ----------------------------------------------------------------

    num_layers = Size(lambda config: config.num_hidden_layers)
    hidden_size = Size(lambda config: config.hidden_size)
    num_heads = Size(_num_heads)
    num_kv_heads = Size(lambda config: getattr(config, "num_key_value_heads", None) or _num_heads(config))
    head_dim = Size(lambda config: getattr(config, "head_dim", None) or config.hidden_size // _num_heads(config))
    intermediate_size = Size(lambda config: config.intermediate_size)
    vocab_size = Size(lambda config: config.vocab_size)
    num_experts = Size(_first_of("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"))
    num_experts_per_token = Size(_first_of("num_experts_per_tok", "moe_k", "moe_topk", "top_k"))

    # -- nnterp migration aliases ---------------------------------------------

    layers_input = Migration("layer_input")
    layers_output = Migration("layer_output")
    attentions_output = Migration("attention_output")
    mlps_output = Migration("mlp_output")
    attention_probabilities = Migration("attention_probabilities", child="self_attn")
    attentions_input = Migration("attention_input", child="self_attn")
    mlps_input = Migration("mlp_input", child="mlp")
    attentions = ModuleMigration("self_attn", "attention_output")
    mlps = ModuleMigration("mlp", "mlp_output")

    # -- loading --------------------------------------------------------------

    @staticmethod
    def _read_config(checkpoint: Any, revision: str | None = None, trust_remote_code: bool = False) -> Any:
        """The config of ``checkpoint`` (a loaded module, a local directory or a hub id), read before any build."""
        if isinstance(checkpoint, torch.nn.Module):
            return checkpoint.config
        path = os.fspath(checkpoint)
        expanded = os.path.expanduser(path)
        if not os.path.isdir(expanded) and (os.path.isabs(expanded) or path.startswith((".", "~"))):
            raise FileNotFoundError(
                f"checkpoint directory {path!r} does not exist (looked at {os.path.abspath(expanded)!r}); "
                "pass an existing directory holding config.json, or a hub id"
            )
        from transformers import AutoConfig

        if os.path.isdir(expanded):
            config_file = os.path.join(expanded, "config.json")
            if not os.path.isfile(config_file):
                raise FileNotFoundError(
                    f"checkpoint directory {path!r} has no config.json; a checkpoint directory holds the "
                    "config.json and weights that `save_pretrained` writes"
                )
            try:
                with open(config_file) as handle:
                    json.load(handle)
            except (ValueError, UnicodeDecodeError) as error:
                raise ValueError(
                    f"{config_file} is not valid JSON ({error}); restore it or save the model again"
                ) from None
        try:
            return AutoConfig.from_pretrained(expanded, revision=revision, trust_remote_code=trust_remote_code)
        except OSError as error:
            raise OSError(
                f"could not read a config for {path!r}: it is not a local directory, and the hub answered: {error}"
            ) from error

    def _maps(
        self,
        checkpoint: Any,
        family: Any,
        rename: dict[str, str] | None,
        envoys: dict[Any, type] | None,
        kwargs: dict[str, Any],
        base_envoys: dict[Any, type],
        saes: SAEs = None,
    ) -> dict[str, dict]:
        """Read the config, settle the family, load and check the SAEs the model holds (``saes``), and merge the
        ``rename``/``envoys`` maps nnsight gets; all before any weights load.

        Later keys win: for ``rename`` the block-norm spellings every family shares (`BLOCK_NORMS`), then
        the family's, then the caller's, and the final norm answers to ``ln_final`` too; for ``envoys``
        the engine's base envoys (tensor-parallel ones on a sharded load), then the family's, then the caller's.
        """
        config = self._read_config(checkpoint, kwargs.get("revision"), kwargs.get("trust_remote_code", False))
        family = family or families.lookup(self._model_type(config), engine=self.ENGINE)
        self._serve_with(family)
        self._hold_saes(saes, config)
        return {
            "rename": standard_rename(family, rename),
            "envoys": {**base_envoys, "layers": Layers, **family.ENVOYS, **(envoys or {})},
        }

    def _hold_saes(self, saes: SAEs, config: Any) -> None:
        """Hold ``saes`` (paths of SAELens directories or loaded `SAE`), loaded and checked by `sae_list` against
        the sizes ``config`` gives this model (its family's rule first), before the model is built."""
        before_build = _Unbuilt(config, self.family)
        num_layers, hidden_size = (
            getattr(type(self), size).__get__(before_build) for size in ("num_layers", "hidden_size")
        )
        self._saes = HeldSAEs(sae_list(saes, num_layers, hidden_size))

    @property
    def saes(self) -> HeldSAEs:
        """The SAEs this model holds (built with ``saes=[...]``), by name: ``model.saes["name"]``;
        ``model.saes.at(layer)`` is the one reading block ``layer``'s output (its ``sae_features``), or ``None``."""
        held = self.__dict__.get("_saes")
        return held if held is not None else HeldSAEs()

    @staticmethod
    def _model_type(config: Any) -> str:
        """The model_type the family is looked up by: the text model's, on a multimodal config."""
        text = getattr(config, "text_config", None)
        return getattr(text, "model_type", None) or config.model_type

    # -- the remote key -------------------------------------------------------

    def _remote_backend(self, remote: bool | str, blocking: bool, job_id: str | None, verbose: bool) -> Any:
        """Where ``trace(..., remote=...)`` sends the trace: ``"local"`` is the dry run against a server with this
        library installed (`engines.remote.InstalledServerSimulation`); ``True`` or a host URL is nnsight's."""
        if remote == "local":
            from .engines.remote import InstalledServerSimulation

            return InstalledServerSimulation(self, verbose=verbose)
        return super()._remote_backend(remote, blocking, job_id, verbose)  # type: ignore[misc]

    # -- support --------------------------------------------------------------

    def support(self) -> dict[str, Any]:
        """Every value -> ``None`` when available, else the reason it is not.

        Block values are keyed by their name on the block (``"layer_output"``) or on its
        module (``"self_attn.attention_probabilities"``); one missing on every block for the
        same reason reads as that reason, one missing on some blocks as ``{layer: reason}``.
        ``"engine"`` names the engine the table is for.
        """
        table: dict[str, Any] = {"engine": self.ENGINE}
        for name, value in values_of(type(self)).items():
            table[name] = value.reason(self)
        per_layer = [_block_support(block) for block in self.layers]
        for name in dict.fromkeys(name for block in per_layer for name in block):
            reasons = [block.get(name, f"this block has no {name}") for block in per_layer]
            missing = {layer: reason for layer, reason in enumerate(reasons) if reason}
            whole = len(missing) == len(reasons) and len(set(reasons)) == 1
            table[name] = reasons[0] if whole else missing or None
        return table

    # -- methods --------------------------------------------------------------

    def steer(
        self,
        layers: LayerSelection,
        vector: torch.Tensor | None = None,
        factor: float = 1.0,
        positions: Positions = None,
        token_positions: Positions = None,
        batch_index: int | Iterable[int] | None = None,
        *,
        steering_vector: torch.Tensor | None = None,
        when: Gate | None = None,
        scale: str = "absolute",
    ) -> None:
        """Add ``factor * vector`` to the residual stream leaving ``layers``, at ``positions`` (all by default).

        ``vector`` is ``[hidden_size]``, or ``[n, hidden_size]`` with one row per selected position.
        ``batch_index`` steers only those rows of the invoke's batch (all by default; on vLLM an invoke
        holds one prompt). nnterp's spellings name the same arguments: ``steering_vector=`` is ``vector``,
        ``token_positions=`` is ``positions``. ``when``: a gate, as `nnterp_vllm.Steering` takes it
        (``(Probe, op, threshold)`` or ``(sae, feature, op, threshold)``, read at a block at or before the first
        of ``layers``): only the tokens whose read passes are steered. Call inside a trace or generate, before the
        first steered layer (and the gate's block) runs. The arguments are checked before anything is read from
        the model; positions and batch rows against the invoke's prompt.

        ``scale``: ``"absolute"`` (default) adds ``factor * vector``; ``"relative"`` adds ``factor * |h| * vector /
        |vector|`` (each row of a ``[n, hidden_size]`` vector normalised on its own), ``h`` the stream leaving the
        block at that token before any edit there and ``|h|`` its L2 norm over the hidden dimension, in float32:
        the factor is a fraction of the stream's own size, comparable across blocks and models. What
        ``nnterp_vllm.Steering(..., scale="relative")`` does inside the steered engine.
        """
        from .steering.specs import check_scale, relative_addition, relative_direction, unit_direction

        require_trace("steer")
        vector = _one_spelling("steer", ("vector", vector), ("steering_vector", steering_vector), required=True)
        chosen = _one_spelling("steer", ("positions", positions), ("token_positions", token_positions))
        indices = arguments.layer_indices(layers, self.num_layers, "steer")
        vector = arguments.hidden_vector(vector, self.hidden_size, "steer")
        factor = arguments.finite_number(factor, "steer")
        check_scale(scale, "steer")
        relative = scale == "relative"
        if relative:
            for row in vector.reshape(-1, vector.shape[-1]):
                unit_direction(row, "steer (scale='relative')")
            unit = relative_direction(vector)

        def add(selected: torch.Tensor, unsteered: torch.Tensor) -> torch.Tensor:
            if vector.dim() == 2 and vector.shape[0] not in (1, selected.shape[1]):
                raise ValueError(
                    f"steer: a [n, hidden_size] vector needs one row per steered position; it has "
                    f"{vector.shape[0]} rows for {selected.shape[1]} positions"
                )
            if relative:
                return selected + relative_addition(unit, factor, unsteered, selected.dtype)
            return selected + factor * vector.to(device=selected.device, dtype=selected.dtype)

        self._edit_stream("steer", self._block_outputs(indices), chosen, batch_index, add, when)

    def cap(
        self,
        layers: LayerSelection,
        vector: torch.Tensor,
        min: float | None = None,
        max: float | None = None,
        positions: Positions = None,
        batch_index: int | Iterable[int] | None = None,
        *,
        when: Gate | None = None,
    ) -> None:
        """Clamp the residual stream's projection on the direction ``vector`` (``[hidden_size]``, normalised here)
        to ``[min, max]`` where it leaves ``layers``, at ``positions`` (all by default) and ``batch_index`` rows (as
        `steer` takes them), on the tokens whose gate ``when`` passes (all without one; as `steer` takes it): the
        stream ``h`` becomes ``h + (clamp(h . u, min, max) - h . u) * u``. Either bound may be left out, not both.
        What `nnterp_vllm.Cap` does inside the steered engine. Call inside a trace."""
        from .steering.specs import Cap

        require_trace("cap")
        self._apply_direction(Cap(vector, layers, min, max, when=when), positions, batch_index)

    def ablate(
        self,
        layers: LayerSelection | str,
        vector: torch.Tensor,
        positions: Positions = None,
        batch_index: int | Iterable[int] | None = None,
        *,
        when: Gate | None = None,
    ) -> None:
        """Remove the direction ``vector`` (``[hidden_size]``, normalised here) from the residual stream, at
        ``positions`` (all by default) and ``batch_index`` rows (as `steer` takes them): the stream ``h`` becomes
        ``h - (h . u) * u``. ``layers="all"``: at every residual-stream location (the stream entering the first
        block, what each block's attention and MLP add), so the stream never carries it (`nnterp_vllm.Ablate`
        says which locations and why); else the stream leaving those blocks. ``when``: a gate, as `steer` takes it
        (with block indices only): only the tokens whose read passes lose the direction. What `nnterp_vllm.Ablate`
        does inside the steered engine. Call inside a trace, before the first block it edits runs (with ``"all"``,
        after every other edit of the invoke: it edits every block)."""
        from .steering.specs import Ablate

        require_trace("ablate")
        self._apply_direction(Ablate(vector, layers, when=when), positions, batch_index)

    def clamp(
        self,
        sae: SAE | str | os.PathLike,
        feature: int,
        value: float | None = None,
        scale: float | None = None,
        positions: Positions = None,
        batch_index: int | Iterable[int] | None = None,
        *,
        when: Gate | None = None,
    ) -> None:
        """Set feature ``feature`` of the SAE ``sae`` to ``value`` (or multiply it by ``scale``; give exactly one)
        where the stream it reads leaves its block, at ``positions`` (all by default) and ``batch_index`` rows (as
        `steer` takes them): the stream ``h`` becomes ``h + (target - a) * d``, ``a`` the feature's activation by
        the SAE's own encoder (``sae.encode(h)[..., feature]``, as SAELens computes it), ``d`` its decoder row
        (``sae.decoder_rows()[feature]``) and ``target`` ``value`` or ``scale * a``. ``sae`` is the name of an SAE
        the model holds (``saes=[...]``), a loaded `SAE` or a SAELens SAE directory. ``when``: a gate, as `steer`
        takes it: only the tokens whose read passes are clamped. What `nnterp_vllm.Clamp` does inside the steered
        engine. Call inside a trace, before the SAE's block runs."""
        from .steering.specs import Clamp, feature_change

        require_trace("clamp")
        spec = Clamp(self._sae_named(sae), feature, value, scale, when=when)
        sae = spec.sae
        if sae.layer >= self.num_layers or sae.d_in != self.hidden_size:
            raise ValueError(
                f"clamp: {sae.path} reads block {sae.layer}'s output, {sae.d_in} wide; this model has "
                f"{self.num_layers} blocks, {self.hidden_size} wide"
            )
        low, high = spec.bounds if spec.value is not None else (-math.inf, math.inf)
        factor = 1.0 if spec.scale is None else spec.scale

        def clamped(selected: torch.Tensor, unsteered: torch.Tensor) -> torch.Tensor:
            on = sae.on(selected.device)
            row = on.decoder_rows()[spec.feature]
            active = on.encode(selected)[..., spec.feature]
            return selected + feature_change(selected, row, row, low, high, scale=factor, pre=active)

        self._edit_stream("clamp", self._block_outputs([sae.layer]), positions, batch_index, clamped, spec.when)

    def patch(
        self,
        layers: LayerSelection,
        vectors: torch.Tensor | Sequence[Any],
        positions: Sequence[int],
        value: str = "layer_output",
        batch_index: int | Iterable[int] | None = None,
    ) -> None:
        """Set ``value`` (``"layer_output"``, ``"attention_output"`` or ``"mlp_output"``) of the blocks ``layers`` to
        ``vectors`` at the prompt ``positions`` of the ``batch_index`` rows (all by default): ``h' = v`` there.
        ``vectors`` is one ``[hidden_size]`` vector for every position or ``[len(positions), hidden_size]``, a row per
        position in the order given (activation patching: rows a clean run saved). What `nnterp_vllm.Patch` does
        inside the steered engine. Call inside a trace, before the first patched block runs."""
        from .steering.specs import Patch

        require_trace("patch")
        spec = Patch(vectors, layers, positions, value)
        indices = arguments.layer_indices(spec.layers, self.num_layers, "patch")
        rows = arguments.hidden_vector(spec.rows(), self.hidden_size, "patch")
        stream = spec.value == "layer_output"
        targets = [
            (*writable_value(self, f"layers.{index}.{spec.value}", "patch"), index if stream else None)
            for index in indices
        ]

        def set_rows(selected: torch.Tensor, unsteered: torch.Tensor) -> torch.Tensor:
            return rows.to(device=selected.device, dtype=selected.dtype).expand_as(selected)

        self._edit_stream("patch", targets, spec.positions, batch_index, set_rows)

    def _sae_named(self, sae: Any) -> Any:
        """``sae`` as `clamp` takes it: the held SAE of that name, else as given (a loaded SAE or a directory)."""
        if not isinstance(sae, str):
            return sae
        if sae in self.saes:
            return self.saes[sae]
        if not os.path.isdir(sae):
            held = ", ".join(repr(name) for name in self.saes) or "none (build the model with saes=[...])"
            raise ValueError(f"clamp: {sae!r} is neither an SAE this model holds nor an SAE directory; it holds {held}")
        return sae

    def _apply_direction(self, spec: Any, positions: Positions, batch_index: Any) -> None:
        """A checked `Cap` (or `Ablate`) applied where it names, by `_edit_stream`."""
        from .steering.specs import EVERYWHERE, EVERYWHERE_VALUES, projection_change

        what = spec.what.lower()
        if spec.layers == EVERYWHERE:
            names = [name.replace("*", str(i)) for i in range(self.num_layers) for name in EVERYWHERE_VALUES]
            targets = [(*writable_value(self, name, f"{what}(layers='all')"), None) for name in dict.fromkeys(names)]
        else:
            targets = self._block_outputs(arguments.layer_indices(spec.layers, self.num_layers, what))
        direction = arguments.hidden_vector(spec.vector, self.hidden_size, what, rows=False)

        def clamp(selected: torch.Tensor, unsteered: torch.Tensor) -> torch.Tensor:
            unit = direction.to(device=selected.device)
            return selected + projection_change(selected, unit, spec.min, spec.max)

        self._edit_stream(what, targets, positions, batch_index, clamp, spec.when)

    def _block_outputs(self, indices: Iterable[int]) -> list[tuple[Any, Value, int]]:
        """The ``layer_output`` of the blocks ``indices`` as `_edit_stream` targets."""
        return [(self.layers[index], type(self.layers[index]).layer_output, index) for index in indices]

    def _edit_stream(
        self,
        what: str,
        targets: list[tuple[Any, Value, int | None]],
        positions: Positions,
        batch_index: Any,
        edit: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        when: Gate | None = None,
    ) -> None:
        """Replace each ``(host, value, block)`` of ``targets`` (in forward order; ``block`` the index of the block
        whose output the value is, else ``None``), at ``positions`` of the ``batch_index`` rows, by ``edit`` of it
        (``[rows, positions, hidden]`` in, the same out; its second argument the same positions of the value before
        any edit at that block, `_unsteered`, which a relative `steer` measures), only on the tokens whose gate
        ``when`` passes where one is given: read at its block's output before the steering there (`_unsteered`), as
        the steered engine reads it. Arguments checked first."""
        from .steering.probes import gate_passes
        from .steering.specs import gate_before

        where = arguments.positions(_listed(positions), what)
        batch = arguments.batch_rows(_listed(batch_index), what)
        blocks = [block for *_, block in targets]
        gate = None if when is None else gate_before(when, blocks, self.num_layers, self.hidden_size, what)
        passed: list[torch.Tensor] = []  # the gate's verdict per token, once read

        def replaced(stream: torch.Tensor, host: Any, value: Value, block: int | None) -> torch.Tensor:
            selected = arguments.positions_within(where, stream.shape[1], what)
            rows = arguments.batch_rows_within(batch, stream.shape[0], what)
            before = stream if block is None else _unsteered(host, value, block, stream)
            if gate is not None and block == gate["layer"]:
                passed.append(gate_passes(gate, before))
            stream = stream.clone()
            at = (torch.tensor(rows)[:, None], torch.tensor(selected))
            changed = edit(stream[at], before[at])
            if gate is not None:
                changed = torch.where(passed[-1].to(stream.device)[at][..., None], changed, stream[at])
            stream[at] = changed
            return stream

        if gate is not None and gate["layer"] not in blocks:
            host = self.layers[gate["layer"]]
            value = type(host).layer_output
            passed.append(gate_passes(gate, _unsteered(host, value, gate["layer"], value.peek(host))))
        for host, value, block in targets:
            value.update(host, partial(replaced, host=host, value=value, block=block))

    def skip_layers(
        self,
        start: int,
        end: int | None = None,
        skip_with: torch.Tensor | None = None,
        layer_returns_tuple: bool | None = None,
    ) -> None:
        """Make blocks ``start..end`` (inclusive) hand their input on unchanged. Call inside a trace.

        ``skip_with`` (nnterp's option): the residual stream the skipped blocks hand on instead.
        ``layer_returns_tuple`` is accepted from nnterp code and changes nothing (``layer_output`` is a tensor).
        """
        require_trace("skip_layers")
        end = start if end is None else end
        first, last = (arguments.layer_indices(index, self.num_layers, "skip_layers")[0] for index in (start, end))
        if first > last:
            raise ValueError(f"skip_layers: start ({start}) must not come after end ({end})")
        for index in range(first, last + 1):
            block = self.layers[index]
            block.layer_output = block.layer_input.clone() if skip_with is None else skip_with

    def skip_layer(self, layer: int, skip_with: torch.Tensor | None = None) -> None:
        """nnterp's spelling of ``skip_layers(layer, layer, skip_with)``."""
        self.skip_layers(layer, layer, skip_with)

    def detect_layer_output_type(self) -> None:
        """nnterp's step before ``skip_layers``; nothing to detect here (``layer_output`` is always a tensor)."""

    @property
    def _model(self) -> torch.nn.Module:
        """The wrapped torch module, under the name nnsight gave it before 0.8 (nnterp code reads ``model._model``)."""
        return self._module

    @property
    def attn_probs_available(self) -> bool:
        """nnterp's spelling: whether every block serves its attention pattern (``support()`` says why not)."""
        return self.support().get("self_attn.attention_probabilities", "no attention") is None

    def project_on_vocab(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits for a residual-stream state: the final norm, the head, and whatever the family does after it.

        The family's ``post_head(model, logits)`` (a soft cap, a scale) runs last where it has one;
        its ``final_norm(model, hidden)`` replaces the final norm where the model has none or calls it otherwise.
        """
        logits = self._unembed(self._final_norm(hidden))
        return self._post_head(logits)

    def _post_head(self, logits: torch.Tensor) -> torch.Tensor:
        post_head = getattr(self.family, "post_head", None)
        return post_head(self, logits) if callable(post_head) else logits

    @property
    def _unembedding_name(self) -> str:
        """The module projecting onto the vocabulary: ``lm_head``, or the family's ``UNEMBEDDING`` where
        ``lm_head`` is taken by a module of the model's own (a prediction transform before the projection)."""
        return getattr(self.family, "UNEMBEDDING", "lm_head")

    def _final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        final_norm = getattr(self.family, "final_norm", None)
        return final_norm(self, hidden) if callable(final_norm) else self.norm(hidden)

    def _unembed(self, normed: torch.Tensor) -> torch.Tensor:
        return getattr(self, self._unembedding_name)(normed)

    def get_topk_closest_tokens(self, vector: torch.Tensor, k: int = 10) -> list[list[tuple[str, float]]]:
        """The ``k`` tokens whose unembedding rows are closest (cosine) to ``vector``.

        One list of ``(token, similarity)`` per row of ``vector`` (a single vector gives one list).
        """
        vector = arguments.hidden_vector(vector, self.hidden_size, "get_topk_closest_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or not 0 < k <= self.vocab_size:
            raise ValueError(f"get_topk_closest_tokens: k must be an int in 1..vocab_size={self.vocab_size}, got {k!r}")
        unembedding = self._unembedding().float()
        rows = vector.reshape(-1, self.hidden_size).float().to(unembedding.device)
        similarity = torch.nn.functional.normalize(rows, dim=-1) @ torch.nn.functional.normalize(unembedding, dim=-1).T
        top = similarity.topk(k, dim=-1)
        return [
            [(self.tokenizer.decode([token]), score) for token, score in zip(ids.tolist(), scores.tolist())]
            for ids, scores in zip(top.indices, top.values)
        ]

    def _unembedding(self) -> torch.Tensor:
        return getattr(self, self._unembedding_name)._module.weight

    def logit_lens(self, prompts: Any, position: int = -1) -> torch.Tensor:
        """Next-token probabilities read off every block's output at ``position``: ``[batch, num_layers, vocab]``."""
        if isinstance(position, bool) or not isinstance(position, int):
            raise ValueError(f"logit_lens: position must be an int, got {position!r}")
        with self.trace(prompts):
            per_layer = []
            for block in self.layers:
                stream = block.layer_output
                (at,) = arguments.positions_within(position, stream.shape[1], "logit_lens")
                per_layer.append(torch.softmax(self.project_on_vocab(stream[:, at]).float(), dim=-1))
            probabilities = torch.stack(per_layer, dim=1).save()
        return probabilities


def _unsteered(host: Any, value: Value, block: int, stream: torch.Tensor) -> torch.Tensor:
    """Block ``block``'s output before any steering edit at it, at this visit of the invoke's worker: the stream the
    first edit (or gate read) there found, recorded now if none did (``stream``: the output as the trace holds it
    now, ``value`` on ``host``)."""
    mediator = Mediator.current(f"{host.path}.{value.name}")
    visit = mediator.occurrence(value.locate(host)[0])
    held = _UNSTEERED.setdefault(mediator, {})
    if block not in held or held[block][0] != visit:
        held[block] = (visit, stream)
    return held[block][1]


def _one_spelling(what: str, ours: tuple[str, Any], nnterps: tuple[str, Any], required: bool = False) -> Any:
    """The argument given under our name or nnterp's (never both), e.g. ``vector`` / ``steering_vector``."""
    (name, value), (other, other_value) = ours, nnterps
    if value is not None and other_value is not None:
        raise ValueError(f"{what}: {name}= and {other}= are two spellings of one argument; give one, not both")
    if required and value is None and other_value is None:
        raise TypeError(f"{what}: missing the {name} argument (nnterp spells it {other}=)")
    return other_value if value is None else value


def _listed(chosen: Any) -> Any:
    """A tensor of indices (as nnterp code passes them) as an int or a list of ints; anything else as it is."""
    return chosen.tolist() if isinstance(chosen, torch.Tensor) else chosen


def max_positions(config: Any) -> int | None:
    """The longest input the config says the model takes, or ``None`` where it names no limit."""
    config = config.get_text_config()
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx"):
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def standard_rename(family: Any, rename: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``rename`` map nnsight gets for a model ``family`` serves: the block-norm spellings every family
    shares, then the family's, then the caller's ``rename``; the final norm answers to ``ln_final`` too."""
    names = {**BLOCK_NORMS, **_with_nested_text_model(family.RENAME), **(rename or {})}
    return _with_final_norm_alias(names)


#: Where a multimodal model (``...ForConditionalGeneration``) keeps its text model: ``model.language_model``.
NESTED_TEXT_MODEL = "model.language_model."


def _with_nested_text_model(rename: dict[str, str]) -> dict[str, str]:
    """A family's RENAME, plus each ``model.``-rooted path as it is spelled inside a multimodal model.

    A text family then serves the same text model wrapped with a vision tower (Gemma-3, Llama-4, Qwen3.5);
    nnsight skips the spellings that match nothing.
    """
    nested = {
        NESTED_TEXT_MODEL + path.removeprefix("model."): name
        for path, name in rename.items()
        if isinstance(path, str) and path.startswith("model.")
    }
    return {**rename, **nested}


#: What nnterp users call the final norm, besides ``norm``.
FINAL_NORM_ALIAS = "ln_final"


def _with_final_norm_alias(rename: dict[str, Any]) -> dict[str, Any]:
    """``rename`` with the module aliased ``norm`` also answering to `FINAL_NORM_ALIAS`, at the root and,
    as nnterp names it, where it sits (``model.model.ln_final`` beside ``model.model.norm``)."""
    aliased = {}
    for path, names in rename.items():
        names = [names] if isinstance(names, str) else list(names)
        if "norm" in names:
            names.append(FINAL_NORM_ALIAS)
            if isinstance(path, str) and "." in path and "*" not in path:
                names.append(f"{path.rpartition('.')[0]}.{FINAL_NORM_ALIAS}")
        aliased[path] = names
    return aliased


def family_gaps(cls: type) -> type:
    """Let a family mark root values of ``cls`` unavailable, with ``UNAVAILABLE = {value: reason}``."""
    for name, value in vars(cls).items():
        if isinstance(value, Value) and not name.startswith("_"):
            value.unavailable = partial(_family_gap, name=name)
    return cls


def _family_gap(model: Any, name: str) -> str | None:
    return getattr(model.family, "UNAVAILABLE", {}).get(name)


def _block_support(block: Any) -> dict[str, str | None]:
    """One block's values by name: its own, and its standardized modules' as ``module.value``."""
    table = dict(block.support()) if isinstance(block, Standard) else {}
    for name, child in _standard_children(block).items():
        for value, reason in child.support().items():
            table[f"{name}.{value}"] = reason
    return table


def _standard_children(block: Any) -> dict[str, Standard]:
    """A block's standardized modules, by their standard name where an alias is bound."""
    found: dict[int, str] = {}
    for name, child in vars(block).items():
        if isinstance(child, Standard) and child is not block:
            if id(child) not in found or name in block._aliases:
                found[id(child)] = name
    return {name: block.__dict__[name] for name in found.values()}


family_gaps(Standardized)
