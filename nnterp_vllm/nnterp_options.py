"""The constructor options nnterp users pass, taken with their meaning on either engine, or refused with the reason.

`take` is called by both engines' constructors before anything loads: it removes nnterp's options
from the keyword arguments, translates those that have a meaning here (into ``rename`` entries,
``attn_implementation``, tokenizer settings) and refuses the rest, naming why and what to do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import families

#: Options nnterp needs for its own load-time checks; here the checks (family lookup, the default family's
#: ``check``) always run and run no forward pass, so these change nothing and are accepted as they are.
#: ``remote=True`` among them: nnterp built such a model without loading weights, as every model is built here (its
#: weights load when a local trace first needs them); its traces go elsewhere with ``trace(..., remote=...)``.
WITHOUT_EFFECT = ("check_renaming", "allow_dispatch", "check_attn_probs_with_trace", "allow_multimodal", "remote")

#: nnterp's earlier ``<module>_rename=`` options and `RenameConfig`'s ``<module>_name`` fields: the native
#: name(s) of a module, given the standard name it answers to here.
STANDARD_NAMES = {
    "model": "model",
    "layers": "layers",
    "attn": "self_attn",
    "mlp": "mlp",
    "ln_final": "norm",
    "lm_head": "lm_head",
}


@dataclass
class RenameConfig:
    """nnterp's configuration of a model's module names (``StandardizedTransformer(..., rename_config=...)``).

    The ``*_name`` fields (a native name, or a list of them) become ``rename`` entries: the module answers
    to the standard name (``attn_name="attention"`` makes ``layers[i].self_attn`` that module). The other
    fields describe what a family module says here; a config setting them is refused with the reason.
    """

    attn_name: str | list[str] | None = None
    mlp_name: str | list[str] | None = None
    ln_final_name: str | list[str] | None = None
    lm_head_name: str | list[str] | None = None
    model_name: str | list[str] | None = None
    layers_name: str | list[str] | None = None
    attn_prob_source: Any = None
    ignore_mlp: bool | None = None
    ignore_attn: bool | None = None
    attn_head_config_key: str | list[str] | int | None = None
    hidden_size_config_key: str | list[str] | int | None = None
    vocab_size_config_key: str | list[str] | int | None = None

    #: Why each field that is not a name cannot be honoured, and what does its job here.
    REFUSED = {
        "attn_prob_source": "the pattern is read where the family's Attention says (its PROBABILITIES operation)",
        "attn_head_config_key": "sizes are read from the config's standard keys or a family's `def num_heads(model)`",
        "hidden_size_config_key": "sizes are read from the config's standard keys or a family's `def hidden_size`",
        "vocab_size_config_key": "sizes are read from the config's standard keys or a family's `def vocab_size`",
    }

    def rename(self) -> dict[str, str]:
        """The ``rename`` entries the name fields give; raises for a field that cannot be honoured."""
        for name, reason in self.REFUSED.items():
            if getattr(self, name) is not None:
                raise ValueError(
                    f"RenameConfig({name}=...) is not supported: {reason}. Serve such a model with your own "
                    "family module: StandardizedTransformer(..., family=module)"
                )
        entries: dict[str, str] = {}
        for module, standard in STANDARD_NAMES.items():
            entries.update(_renamed(getattr(self, f"{module}_name"), standard))
        return entries


def _renamed(native: str | list[str] | None, standard: str) -> dict[str, str]:
    names = [] if native is None else [native] if isinstance(native, str) else list(native)
    return dict.fromkeys(names, standard)


@dataclass
class Options:
    """nnterp's options taken out of a constructor call: ``rename`` entries and what to set after the build."""

    rename: dict[str, str] = field(default_factory=dict)
    tokenizer: dict[str, Any] = field(default_factory=dict)

    def merged(self, rename: dict[str, Any] | None) -> dict[str, Any] | None:
        """The caller's ``rename`` over the entries nnterp's options gave."""
        return {**self.rename, **(rename or {})} if self.rename else rename

    def apply(self, model: Any) -> None:
        """Settings that need the built model: ``tokenizer_kwargs`` go onto its tokenizer, as nnterp did."""
        for key, value in self.tokenizer.items():
            setattr(model.tokenizer, key, value)


def take(kwargs: dict[str, Any], engine: str) -> Options:
    """Remove nnterp's options from ``kwargs`` (in place), apply their meaning for ``engine``, refuse the rest.

    - ``enable_attention_probs=True``: the attention pattern is wanted. On transformers that is eager
      attention (the default here; another ``attn_implementation`` is refused); on vLLM it changes nothing
      (the pattern is rebuilt from the kernel's queries and keys when read). ``False``: transformers' default
      attention is used (the pattern and the attention interior then report unavailable) unless
      ``attn_implementation`` says; on vLLM it changes nothing.
    - ``rename_config`` and the ``<module>_rename`` options become
      ``rename`` entries; ``tokenizer_kwargs`` are set on the tokenizer after the build; the options in
      `WITHOUT_EFFECT` are accepted. ``trust_remote_code`` and ``rename`` are this library's own too.
    """
    options = Options()
    _enable_attention_probs(kwargs, engine)
    for name in WITHOUT_EFFECT:
        kwargs.pop(name, None)
    config = kwargs.pop("rename_config", None)
    if config is not None:
        if not isinstance(config, RenameConfig):
            raise TypeError(f"rename_config must be a RenameConfig, got {type(config).__name__}")
        options.rename.update(config.rename())
    for module, standard in STANDARD_NAMES.items():
        options.rename.update(_renamed(kwargs.pop(f"{module}_rename", None), standard))
    tokenizer = kwargs.pop("tokenizer_kwargs", None) or {}
    if not isinstance(tokenizer, dict):
        raise TypeError(f"tokenizer_kwargs must be a dict of tokenizer settings, got {type(tokenizer).__name__}")
    options.tokenizer.update(tokenizer)
    return options


def _enable_attention_probs(kwargs: dict[str, Any], engine: str) -> None:
    if "enable_attention_probs" not in kwargs:
        return
    wanted = kwargs.pop("enable_attention_probs")
    implementation = kwargs.get("attn_implementation")
    if engine == families.VLLM:
        return  # vLLM's kernel is the same either way; the pattern is rebuilt when read (free when not)
    if wanted and implementation not in (None, "eager"):
        raise ValueError(
            f"enable_attention_probs=True needs attn_implementation='eager' (the pattern is read inside eager "
            f"attention), got attn_implementation={implementation!r}; pass one or the other"
        )
    kwargs.setdefault("attn_implementation", "eager" if wanted else "sdpa")


__all__ = ["STANDARD_NAMES", "WITHOUT_EFFECT", "Options", "RenameConfig", "take"]
