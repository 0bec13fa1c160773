"""`Standardized`: the engine-independent root of a standardized model.

It knows the root values, the sizes, ``support()``, the loading rules shared by the
engines and the public methods (steering, skipping layers, the logit lens). It never
knows an operation name inside a forward or a family's config keys: a family function
of the same name overrides a size or ``project_on_vocab``.
"""

from __future__ import annotations

import importlib
import os
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import torch

from . import arguments, families
from .components import Derived, Layers, Standard, Value, values_of
from .components.values import require_trace
from .families._layouts import BLOCK_NORMS
from .specs.saes import SAE, sae_list
from .trace_edits import TraceEdits

#: What ``saes=`` takes: SAELens SAE directories or loaded `SAE` (one, or a list of them), or ``None``.
SAEs = SAE | str | os.PathLike | Sequence[SAE | str | os.PathLike] | None

#: Family modules by name, for families handed in as module objects that no import can find.
_FAMILIES: dict[str, Any] = {}


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


class Standardized(TraceEdits):
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

    def _maps(
        self,
        config: Any,
        family: Any,
        rename: dict[str, str] | None,
        envoys: dict[Any, type] | None,
        base_envoys: dict[Any, type],
        saes: SAEs = None,
    ) -> dict[str, dict]:
        """Settle the family of the checkpoint whose ``config`` this is, load and check the SAEs the model holds
        (``saes``), and merge the ``rename``/``envoys`` maps nnsight gets; all before any weights load.

        Later keys win: for ``rename`` the block-norm spellings every family shares (`BLOCK_NORMS`), then
        the family's, then the caller's, and the final norm answers to ``ln_final`` too; for ``envoys``
        the engine's base envoys (tensor-parallel ones on a sharded load), then the family's, then the caller's.
        """
        family = family or families.lookup(families.model_type(config), engine=self.ENGINE)
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

    # -- the remote key -------------------------------------------------------

    def _remote_backend(self, remote: bool | str, blocking: bool, job_id: str | None, verbose: bool) -> Any:
        """Where ``trace(..., remote=...)`` sends the trace: ``"local"`` is the dry run against a server with this
        library installed (`remote.InstalledServerSimulation`); ``True`` or a host URL is nnsight's."""
        if remote == "local":
            from .remote import InstalledServerSimulation

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
