"""StandardizedVLLM on vLLM's CPU build, checked against StandardizedTransformer on the same weights.

Every vLLM family (``families.known("vllm")``, and the multimodal types served through one) runs the same
cross-engine checks, batched per engine build so the whole set stays cheap: one trace reads every value vLLM
claims on every block, and the same values on transformers; one trace runs three invokes (steered, plain,
skipped); one greedy generation is steered. The tests below compare parts of those runs. What the engine does
whatever the family (bad input, the logit lens, prefix caching, tensor parallel) is checked on llama alone.

The coverage harness (tests/family_coverage.py) runs this file on every model_type through
``NNTERP_COVERAGE_TYPES``, and reads each value's verdict from the tests that check it.
"""

from __future__ import annotations

import functools
import os

import nnsight
import pytest
import reference
import tiny
import torch

from nnterp_vllm import StandardizedTransformer, UnsupportedFamily, families
from nnterp_vllm.engines.vllm import StandardizedVLLM

#: Multimodal types whose text model has a vLLM family, served through it (as on transformers).
MULTIMODAL: list[str] = []
VLLM_FAMILIES = [name for name in os.environ.get("NNTERP_COVERAGE_TYPES", "").split(",") if name] or [
    *families.known(families.VLLM),
    *MULTIMODAL,
]
#: fp32 on both engines; the kernels differ (fused add+norm, oneDNN matmuls), so values agree
#: to rounding, which grows through the blocks: 1e-4 relative and absolute covers it with margin.
TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}
#: Per block, in the order the forward computes them: the values one trace reads where vLLM claims them.
BLOCK_VALUES = (
    "layer_input",
    "self_attn.attention_input",
    "self_attn.attention_queries",
    "self_attn.attention_keys",
    "self_attn.attention_values",
    "self_attn.attention_scores",
    "self_attn.attention_probabilities",
    "self_attn.attention_premix",
    "self_attn.attention_head_outputs",
    "attention_output",
    "mixer_output",
    "mlp.mlp_input",
    "mlp.router_logits",
    "mlp.expert_indices",
    "mlp.expert_weights",
    "mlp_output",
    "layer_output",
)
STREAM = (
    "layer_input",
    "self_attn.attention_input",
    "attention_output",
    "mixer_output",
    "mlp.mlp_input",
    "mlp_output",
    "layer_output",
)
PATTERN = ("self_attn.attention_scores", "self_attn.attention_probabilities")
INTERIOR = tuple(name for name in BLOCK_VALUES if name.startswith("self_attn.") and name not in STREAM + PATTERN)
ROUTING = tuple(name for name in BLOCK_VALUES if name.startswith("mlp.") and name not in STREAM)
ROOT_VALUES = ("token_embeddings", "final_norm_output", "logits", "next_token_probs")


def close(actual, expected, msg=None, **tolerance):
    torch.testing.assert_close(actual.detach().float(), expected.detach().float(), msg=msg, **(tolerance or TOLERANCE))


def claimed(table, name, layer=None):
    """Whether a ``support()`` table claims value ``name`` (on block ``layer``, for a block value)."""
    entry = table.get(name, "no block has this module")
    return entry is None or (layer is not None and isinstance(entry, dict) and layer not in entry)


def steer_both_ends(model, vector):
    """Steer the first and last blocks at two positions (inside a trace); the next-token probabilities, saved."""
    model.steer([0, model.num_layers - 1], vector, factor=1.5, positions=[1, -1])
    return model.next_token_probs.save()


def last_output_and_probabilities(model):
    """The last block's output and the next-token probabilities of a plain run (inside a trace), saved."""
    return model.layers[model.num_layers - 1].layer_output.save(), model.next_token_probs.save()


def skip_one(model):
    """Skip block 1 (inside a trace); the next-token probabilities, saved."""
    model.skip_layers(1)
    return model.next_token_probs.save()


class Runs:
    """The runs the checks compare, made once per engine pair; a run that fails is retried by the next test."""

    def __init__(self, model_type, on_vllm, on_hf):
        self.model_type, self.on_vllm, self.on_hf = model_type, on_vllm, on_hf
        self.vllm_table, self.hf_table = on_vllm.support(), on_hf.support()

    @functools.cached_property
    def plan(self):
        """What the values trace reads: ``(layer or None, name)`` for every value vLLM claims and transformers
        claims too (a claim transformers does not make is refused by `test_support_claims_only_verified_values`)."""
        both = (self.vllm_table, self.hf_table)
        plan = [(None, "token_embeddings")] if all(claimed(table, "token_embeddings") for table in both) else []
        for layer in range(self.on_hf.num_layers):
            plan += [(layer, name) for name in BLOCK_VALUES if all(claimed(table, name, layer) for table in both)]
        return plan + [(None, name) for name in ROOT_VALUES[1:] if all(claimed(table, name) for table in both)]

    def _read(self, model):
        plan = self.plan  # a trace body sends what it names to the engine: not this object
        with model.trace(reference.PROMPT):
            saved = nnsight.save([])
            for layer, name in plan:
                saved.append((model if layer is None else model.layers[layer]).get(name))
        return dict(zip(plan, saved))

    @functools.cached_property
    def values(self):
        """``{(layer, name): tensor}`` on each engine: (vLLM's, transformers')."""
        return self._read(self.on_vllm), self._read(self.on_hf)

    @staticmethod
    def _intervened(model, vector):
        """The three interventions as invokes of one trace (vLLM)."""
        with model.trace() as tracer:
            with tracer.invoke(reference.PROMPT):
                steered = steer_both_ends(model, vector)
            with tracer.invoke(reference.OTHER_PROMPT):
                plain, plain_probs = last_output_and_probabilities(model)
            with tracer.invoke(reference.PROMPT):
                skipped = skip_one(model)
        return {"steered": steered, "plain": plain, "plain_probs": plain_probs, "skipped": skipped}

    @staticmethod
    def _intervened_one_by_one(model, vector):
        """The same interventions on transformers, one prompt per trace (no padding between them)."""
        with model.trace(reference.PROMPT):
            steered = steer_both_ends(model, vector)
        with model.trace(reference.OTHER_PROMPT):
            plain, plain_probs = last_output_and_probabilities(model)
        with model.trace(reference.PROMPT):
            skipped = skip_one(model)
        return {"steered": steered, "plain": plain, "plain_probs": plain_probs, "skipped": skipped}

    @functools.cached_property
    def interventions(self):
        """Steered, plain (beside the others) and skipped runs on each engine: (vLLM's, transformers')."""
        vector = torch.randn(self.on_hf.hidden_size, generator=torch.Generator().manual_seed(3)) * 2
        return self._intervened(self.on_vllm, vector), self._intervened_one_by_one(self.on_hf, vector)

    @functools.cached_property
    def generated(self):
        """Four greedy tokens with block 1 steered at every step: (vLLM's, transformers')."""
        on_vllm, on_hf = self.on_vllm, self.on_hf
        vector = torch.randn(on_hf.hidden_size, generator=torch.Generator().manual_seed(4)) * 4
        steps = 4
        with on_vllm.generate(reference.PROMPT, max_new_tokens=steps, do_sample=False, ignore_eos=True) as tracer:
            samples = nnsight.save([])
            for _ in tracer.iter[:steps]:
                on_vllm.steer(1, vector)
                samples.append(on_vllm.samples)
        with on_hf.generate(reference.PROMPT, max_new_tokens=steps, do_sample=False, min_new_tokens=steps) as tracer:
            for _ in tracer.iter[:steps]:
                on_hf.steer(1, vector)
            tokens = tracer.result.save()
        return [int(sample.flatten()[0]) for sample in samples], tokens[0, -steps:].tolist()

    @functools.cached_property
    def generated_patterns(self):
        """Every block's scores and pattern (where both engines claim them) at each of three greedy steps, and
        the tokens generated: (vLLM's, transformers'), each ``(tokens, [per step: {(layer, name): tensor}])``."""
        layers = [i for i in range(self.on_hf.num_layers) if all(claimed(t, PATTERN[1], i) for t in self.tables)]
        return tuple(self._generated_patterns(model, layers) for model in (self.on_vllm, self.on_hf))

    @property
    def tables(self):
        return self.vllm_table, self.hf_table

    @staticmethod
    def _generated_patterns(model, layers, steps=3):
        with model.generate(reference.PROMPT, max_new_tokens=steps, do_sample=False, min_new_tokens=steps) as tracer:
            read = nnsight.save([])
            tokens = nnsight.save([])
            for _ in tracer.iter[:steps]:
                read.append({(i, name): model.layers[i].get(name) for i in layers for name in PATTERN})
                tokens.append(model.next_token_probs.argmax(-1))
        return [int(token.flatten()[0]) for token in tokens], read


@pytest.fixture(scope="module", params=VLLM_FAMILIES)
def runs(request):
    """The runs of one model_type's tiny checkpoint on both engines; the vLLM engine is shut down after."""
    path = tiny.vllm_checkpoint(request.param)
    on_vllm = StandardizedVLLM(path, dtype="float32", dispatch=True)
    yield Runs(request.param, on_vllm, StandardizedTransformer(path))
    on_vllm.shutdown()


def by_expert(values, key):
    """A routing value of ``values`` with each token's chosen experts ordered by expert: the engines may list a
    token's choice in other orders (vLLM by weight, transformers as its top-k returns it)."""
    layer, name = key
    indices = values.get((layer, "mlp.expert_indices"))
    if name not in ("mlp.expert_indices", "mlp.expert_weights") or indices is None:
        return values[key]
    return values[key].gather(-1, indices.argsort(dim=-1))


def compare(runs, names):
    """The values ``names`` read on both engines, compared; how many were."""
    on_vllm, on_hf = runs.values
    compared = 0
    for key, expected in on_hf.items():
        if key[1] in names:
            assert on_vllm[key].shape == expected.shape, key
            got, expected = by_expert(on_vllm, key), by_expert(on_hf, key)
            close(got, expected, msg=lambda message, key=key: f"{key}: {message}", **TOLERANCE)
            compared += 1
    return compared


def test_block_values_equal_transformers(runs):
    assert compare(runs, (*STREAM, *ROOT_VALUES)) >= 2 * runs.on_hf.num_layers


def test_attention_interior_equals_transformers(runs):
    """Queries, keys, values, the per-head mix and each head's output, on every block vLLM serves them."""
    if not compare(runs, INTERIOR):
        pytest.skip(
            f"no attention interior served: {runs.vllm_table.get('self_attn.attention_queries', 'no attention')}"
        )


def test_pattern_equals_transformers(runs):
    """The scores and the pattern, rebuilt on vLLM from its kernel's queries and keys, equal transformers' eager
    attention's on every block both serve them (prompt rows); where vLLM does not, it says why."""
    if not compare(runs, PATTERN):
        reason = runs.vllm_table.get("self_attn.attention_probabilities", "no attention")
        assert reason, "vLLM claims the pattern, but no block's was compared"
        pytest.skip(f"no attention pattern served on vLLM: {reason}")
    on_vllm, _ = runs.values
    for (_, name), pattern in on_vllm.items():
        if name == "self_attn.attention_probabilities":
            close(pattern.sum(-1), torch.ones(pattern.shape[:-1]))


def test_pattern_at_generated_steps_equals_transformers(runs):
    """At each generated step a token's row over its context (vLLM reads the earlier keys back from its KV cache)
    equals transformers' on every block both serve the pattern, after the same greedy tokens."""
    (vllm_tokens, on_vllm), (hf_tokens, on_hf) = runs.generated_patterns
    if not on_hf[0]:
        pytest.skip(f"no attention pattern served on vLLM: {runs.vllm_table.get(PATTERN[1], 'no attention')}")
    assert vllm_tokens == hf_tokens, "the engines chose different greedy tokens; the later rows would differ"
    for step, (vllm_step, hf_step) in enumerate(zip(on_vllm, on_hf)):
        for key, expected in hf_step.items():
            assert on_vllm[step][key].shape == expected.shape, (step, key)
            assert expected.shape[-2] == (1 if step else expected.shape[-1]), (step, key, expected.shape)
            close(vllm_step[key], expected, msg=lambda message, key=key, step=step: f"step {step} {key}: {message}")


def test_routing_equals_transformers(runs):
    """On a mixture of experts: the router's logits and the expert choice (vLLM's rebuilt from the logits by its
    fused kernel's router), on every routed block."""
    routed = [i for i in range(runs.on_hf.num_layers) if claimed(runs.hf_table, "mlp.router_logits", i)]
    if not routed:
        pytest.skip("a dense family: no router")
    assert routed == [i for i in range(runs.on_vllm.num_layers) if claimed(runs.vllm_table, "mlp.router_logits", i)]
    assert compare(runs, ROUTING) >= len(routed)
    chosen = [i for i in routed if claimed(runs.hf_table, "mlp.expert_indices", i)]
    assert chosen == [i for i in routed if claimed(runs.vllm_table, "mlp.expert_indices", i)], runs.vllm_table.get(
        "mlp.expert_indices"
    )
    assert compare(runs, ("mlp.expert_indices", "mlp.expert_weights")) == 2 * len(chosen)


def test_residual_identity_on_vllm(runs):
    """``layer_output == layer_input + mixer_output + mlp_output`` on every block vLLM serves all four."""
    on_vllm, _ = runs.values
    rows = 0
    for layer in range(runs.on_vllm.num_layers):
        parts = [on_vllm.get((layer, name)) for name in ("layer_input", "mixer_output", "mlp_output", "layer_output")]
        if all(part is not None for part in parts):
            close(parts[0] + parts[1] + parts[2], parts[3], atol=1e-5, rtol=1e-5)
            rows += 1
    if not rows:
        pytest.skip(f"no block serves every stream value: {runs.vllm_table['mixer_output']}")


def test_interventions_match_transformers(runs):
    """Steering, skipping and a plain prompt, as three invokes of one vLLM trace, equal transformers' runs."""
    on_vllm, on_hf = runs.interventions
    for name in ("steered", "plain_probs", "skipped"):
        close(on_vllm[name], on_hf[name], msg=lambda message, name=name: f"{name}: {message}", atol=1e-5, rtol=1e-4)
    close(on_vllm["plain"], on_hf["plain"])


def test_steered_greedy_generation_matches_transformers(runs):
    on_vllm, on_hf = runs.generated
    assert on_vllm == on_hf


def test_support_claims_only_verified_values(runs):
    """The same rows on both engines; vLLM claims no value transformers does not serve (and verify there)."""
    vllm_table, hf_table = runs.vllm_table, runs.hf_table
    assert set(vllm_table) == set(hf_table)
    assert vllm_table["engine"] == "vllm" and hf_table["engine"] == "transformers"
    for name, entry in vllm_table.items():
        if name == "engine":
            continue
        layers = range(runs.on_hf.num_layers) if isinstance(entry, dict) or "." in name or name in STREAM else [None]
        for layer in layers:
            if claimed(vllm_table, name, layer):
                assert claimed(hf_table, name, layer), f"{name} (layer {layer}) is claimed on vLLM only"


def test_coverage_row_is_current(runs):
    """COVERAGE.md's vLLM row for this type is what the harness finds (this file verifies its ✓ marks)."""
    import family_coverage as harness
    from test_coverage import checked_in, marks, rows_of

    row = {
        "status": "loaded",
        "family": runs.on_vllm.family.__name__.rsplit(".", 1)[-1],
        "layers": runs.on_vllm.num_layers,
        "support": {name: reason for name, reason in runs.vllm_table.items() if name != "engine"},
    }
    verified = {test: "passed" for tests in harness.VLLM_COLUMNS.values() for test in tests}
    found = rows_of("\n".join(harness.vllm_table({runs.model_type: row}, {runs.model_type: verified})[0]))
    recorded = checked_in()[1].get(runs.model_type)
    assert recorded is not None, f"COVERAGE.md has no vLLM row for {runs.model_type}"
    assert marks(found[runs.model_type]) == marks(recorded), (
        f"COVERAGE.md's vLLM row for {runs.model_type} is stale: the harness finds {found[runs.model_type]!r}; "
        "regenerate it with `python tests/family_coverage.py`"
    )


# -- the engine, whatever the family (on llama) ----------------------------------------------------------------


@pytest.fixture(scope="module")
def llama():
    """llama's tiny checkpoint on both engines."""
    path = tiny.checkpoint("llama")
    on_vllm = StandardizedVLLM(path, dtype="float32", dispatch=True)
    yield on_vllm, StandardizedTransformer(path)
    on_vllm.shutdown()


def test_saved_values_survive_the_rest_of_the_forward(llama):
    """vLLM adds the residual in place inside its fused norm: a read must be a copy, not its buffer."""
    on_vllm, _ = llama
    expected = reference.run(reference.load(tiny.checkpoint("llama")), output_hidden_states=True)
    with on_vllm.trace(reference.PROMPT):
        second = on_vllm.layers[1].layer_input.save()
        third = on_vllm.layers[2].layer_input.save()
    close(second, expected.hidden_states[1])
    close(third, expected.hidden_states[2])


def test_the_engine_survives_each_kind_of_bad_input(llama):
    on_vllm, _ = llama
    bad = [
        lambda: on_vllm.steer(1, torch.zeros(3)),
        lambda: on_vllm.steer(99, torch.zeros(on_vllm.hidden_size)),
        lambda: on_vllm.layers[1].no_such_value.save(),
        lambda: setattr(on_vllm.layers[1], "layer_output", torch.zeros(2, 2)),
        # a write of the rebuilt pattern the bytecode check cannot see, refused inside the engine
        lambda: setattr(on_vllm.layers[1].self_attn, "attention_probabilities", torch.zeros(1, 4, 30, 30)),
        lambda: on_vllm.layers[99],
    ]
    for attempt in bad:
        with pytest.raises(Exception) as caught:  # noqa: PT011 - the type differs per attempt; the message is checked
            with on_vllm.trace(reference.PROMPT):
                attempt()
        message = str(caught.value)
        words = ("shape", "num_layers", "no_such_value", "one prompt", "cannot be written")
        assert any(word in message for word in words), message
        with on_vllm.trace(reference.PROMPT):
            logits = on_vllm.logits.save()
        assert torch.isfinite(logits).all()


def test_logit_lens_and_projection_run_unchanged(llama):
    on_vllm, on_hf = llama
    close(on_vllm.logit_lens(reference.PROMPT), on_hf.logit_lens(reference.PROMPT), atol=1e-5, rtol=1e-4)


def test_nnsight_save_of_a_container_works_on_vllm(llama):
    on_vllm, _ = llama
    with on_vllm.trace(reference.PROMPT):
        saved = nnsight.save([on_vllm.layers[0].layer_output[:, -1]])
    assert saved[0].shape == (1, on_vllm.hidden_size)


def test_unsupported_type_and_prefix_caching_are_refused():
    """Refused before anything loads: with the reason for a type the vLLM engine refuses, and for a type without a
    vLLM family."""
    with pytest.raises(UnsupportedFamily, match=r"model_type 'codegen' is not served on vLLM: no vLLM architecture"):
        StandardizedVLLM(tiny.checkpoint("codegen"))
    with pytest.raises(UnsupportedFamily, match=r"model_type 'bamba' is not served on vLLM: .*attention interface"):
        StandardizedVLLM(tiny.checkpoint("bamba"))
    with pytest.raises(UnsupportedFamily, match=r"no vLLM family for model_type 'no_such_type'.*llama"):
        families.lookup("no_such_type", engine=families.VLLM)
    with pytest.raises(ValueError, match="prefix_caching"):
        StandardizedVLLM(tiny.checkpoint("llama"), enable_prefix_caching=True)


def test_smollm2_on_vllm():
    from nnterp_vllm.checkpoints import smollm2

    path = smollm2()
    on_vllm = StandardizedVLLM(path, dtype="float32", dispatch=True, max_model_len=512)
    try:
        prompt = "The Eiffel Tower is in the city of"
        outputs = []
        with on_vllm.trace(prompt):
            for block in on_vllm.layers:
                outputs.append(block.layer_output.save())
            logits = on_vllm.logits.save()
        assert on_vllm.tokenizer.decode(logits[0, -1].argmax()) == " Paris"
        on_hf = StandardizedTransformer(path)
        expected = []
        with on_hf.trace(prompt):
            for block in on_hf.layers:
                expected.append(block.layer_output.save())
        for got, want in zip(outputs, expected):
            close(got, want, atol=1e-3, rtol=1e-3)
    finally:
        on_vllm.shutdown()


def test_tensor_parallel_serves_whole_values():
    """Two CPU ranks (their threads placed without VLLM_CPU_OMP_THREADS_BIND): heads and vocabulary are split
    across them; every value comes back whole and equal."""
    path = tiny.checkpoint("llama")
    on_vllm = StandardizedVLLM(path, dtype="float32", tensor_parallel_size=2, dispatch=True)
    on_hf = StandardizedTransformer(path)
    names = ("attention_queries", "attention_keys", "attention_premix", "attention_head_outputs")
    try:
        results = []
        for model in (on_vllm, on_hf):
            saved = []
            with model.trace(reference.PROMPT):
                for name in names:
                    saved.append(getattr(model.layers[1].self_attn, name).save())
                model.steer(1, torch.ones(model.hidden_size), factor=0.5)
                saved.append(model.layers[2].layer_output.save())
                saved.append(model.logits.save())
            results.append(saved)
        for vllm_value, hf_value in zip(*results):
            close(vllm_value, hf_value)
        with on_vllm.trace(reference.PROMPT):
            attention = on_vllm.layers[0].self_attn
            attention.attention_values = torch.zeros_like(attention.attention_values)
            silenced = on_vllm.layers[0].attention_output.save()
        assert torch.count_nonzero(silenced) == 0
    finally:
        on_vllm.shutdown()
