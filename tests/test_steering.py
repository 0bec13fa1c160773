"""SteeredVLLM on vLLM's CPU build: steering and capture compiled into the engine equal the nnsight path and
transformers.

Per family (llama: the dual ``(hidden, residual)`` stream; gpt2: one tensor) the references come
first, one engine at a time: plain vLLM, then `StandardizedVLLM` (nnsight), then `SteeredVLLM` is
built for the tests, keeping every stream value. The engine is built small on purpose (16 sequences,
64 tokens a step, a KV cache of a few blocks), so one batch of 32 prompts joins and leaves mid-batch,
prefills in chunks and is preempted.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import nnsight
import pytest
import reference
import tiny
import torch
from vllm import LLM, SamplingParams

from nnterp_vllm import (
    SAE,
    Ablate,
    Cap,
    Capture,
    Clamp,
    StandardizedTransformer,
    StandardizedVLLM,
    SteeredVLLM,
    Steering,
    UnsupportedFamily,
)
from nnterp_vllm.components.names import BLOCK_ORDER
from nnterp_vllm.engines.first_blocks import FIRST_BLOCKS
from nnterp_vllm.engines.lifecycle import shutdown_llm
from nnterp_vllm.engines.steered.steered_settings import kept_values
from nnterp_vllm.specs.selection import Selection
from nnterp_vllm.specs.steering_requests import per_prompt, specs_of

STEPS = 16
BLOCK = 32
GREEDY = {"temperature": 0.0, "max_tokens": STEPS, "ignore_eos": True, "logprobs": 0}
#: Logprobs of the same tokens on two engines, fp32 (fused kernels round differently).
LOGPROB_TOLERANCE = {"atol": 2e-4, "rtol": 1e-4}
#: Kept values against each path's own, by the dtype they are kept in.
KEPT_TOLERANCE = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.float16: {"atol": 2e-3, "rtol": 2e-3}}
SUBJECTS = ["The quick brown fox", "A cup of coffee", "Rome was built", "Quantum computers", "My favourite book"]


def prompt_text(i: int) -> str:
    """Prompts of 40 to 180 byte tokens: the long ones prefill in chunks of the engine's 64-token steps."""
    words = f"{SUBJECTS[i % len(SUBJECTS)]} (note {i}) is"
    return (words + " and so on,") * (1 + (i * 7) % 4) + " then"


#: Every stream value the engine under test keeps (three blocks: 29 values).
KEPT = [
    "token_embeddings",
    "layers.*.layer_input",
    "layers.*.attention_input",
    "layers.*.self_attn.attention_output",
    "layers.*.attention_output",
    "layers.*.mixer_output",
    "layers.*.mlp_input",
    "layers.*.mlp.mlp_output",
    "layers.*.mlp_output",
    "layers.*.layer_output",
    "final_norm_output",
]
#: What the captured requests keep: every position form, values at every kind of location, two dtypes.
CAPTURES = [
    Capture("layers.*.layer_output"),
    Capture(["layers.1.attention_output", "layers.0.mlp_output", "layers.2.layer_input"], positions="prompt"),
    Capture(["token_embeddings", "layers.1.layer_output", "layers.2.mixer_output"], positions="last"),
    Capture(["layers.2.layer_output", "layers.1.mlp_input", "final_norm_output"], positions="generated"),
    Capture(["layers.0.attention_input", "layers.1.self_attn.attention_output"], positions=[0, 2, -1]),
    Capture(["layers.0.layer_output", "layers.2.mlp.mlp_output"], dtype="float16"),
]


def cases(hidden_size: int, saes: dict[str, SAE]) -> list[tuple[str, list[Steering] | None]]:
    """32 prompts: 16 steered by 8 distinct vectors at several layers, factors and positions (added, capped,
    ablated) and by SAE features clamped (``saes``: `SAES`), 16 not."""
    generator = torch.Generator().manual_seed(7)
    vectors = [torch.randn(hidden_size, generator=generator) for _ in range(8)]
    forms = [
        [Steering(0, vectors[0], factor=2.0)],
        [Steering([0, 2], vectors[1], factor=0.5)],
        [Steering(1, vectors[2], factor=3.0, positions="prompt")],
        [Steering(2, vectors[3], factor=2.0, positions="generated")],
        [Steering(1, vectors[4], factor=-1.5, positions=[0, -1])],
        [Steering(-2, vectors[5], factor=2.0, positions=[2])],
        [Steering(0, vectors[6]), Steering(2, vectors[7], factor=3.0, positions=[-2])],
        [Steering(1, vectors[0], positions="prompt"), Steering(1, vectors[3], factor=2.0, positions="generated")],
        [Ablate(vectors[1], layers=[0, 1, 2])],
        [Steering(1, vectors[2], factor=2.0), Cap(vectors[4], layers=1, min=-0.5, max=0.5), Ablate(vectors[5], 1)],
        [Cap(vectors[6], layers=[0, 2], min=1.0, positions="generated"), Steering(2, vectors[7], positions=[1])],
        [Clamp(saes["standard"], 5, value=3.0), Steering(1, vectors[0], positions="generated")],
        [Clamp(saes["topk"], 2, value=2.0, positions=[0, -1]), Cap(vectors[2], layers=2, max=0.05)],
    ]
    steering = [forms[i // 2 % len(forms)] if i % 2 == 0 else None for i in range(32)]
    return [(prompt_text(i), specs) for i, specs in enumerate(steering)]


def capture_of(i: int) -> Capture | None:
    """Prompts 0, 1, 4, 5, ... keep values (half of them steered), the others keep none."""
    return CAPTURES[(i // 4 + i % 2 * 3) % len(CAPTURES)] if i % 4 < 2 else None


def phase_positions(phase, prompt_length: int, fed: int) -> list[int]:
    """The positions of a sequence of ``fed`` tokens (a prompt of ``prompt_length``, then generated ones) a spec's
    ``phase`` (or list of prompt positions) names."""
    if phase == "all":
        return list(range(fed))
    if phase == "prompt":
        return list(range(prompt_length))
    if phase == "generated":
        return list(range(prompt_length, fed))
    if phase == "last":
        return [prompt_length - 1]
    return sorted({position % prompt_length for position in phase})


def selection_named(name: str) -> Selection:
    parts = name.split(".", 2)
    return Selection(None, name) if parts[0] != "layers" else Selection(int(parts[1]), parts[2])


def forced_values(model, prompt_ids: list[int], generated: list[int], specs, names: list[str]) -> dict:
    """Every named value at every position of one forward over the prompt and the generated tokens fed back in
    (all but the last), each spec steered at its positions, read as the README teaches on either engine."""
    fed = len(prompt_ids) + len(generated) - 1
    steered: dict[int, list] = {}
    for spec in specs or []:
        for layer in spec.layers:
            positions = phase_positions(spec.positions, len(prompt_ids), fed)
            steered.setdefault(layer % model.num_layers, []).append((spec, positions))
    wanted = [selection_named(name) for name in names]
    # Forward order, each block's steering at its output: before its layer_output is read, after all else.
    steps = [(selection.order(), selection) for selection in wanted]
    steps += [((layer, BLOCK_ORDER.index("layer_output") - 0.5), layer) for layer in steered]
    with model.trace(prompt_ids + generated[:-1]):
        found = nnsight.save({})
        for _, step in sorted(steps, key=lambda item: item[0]):
            if isinstance(step, int):
                for spec, positions in steered[step]:
                    reference.intervene(model, step, spec, positions)
                continue
            host = model if step.layer is None else model.layers[step.layer]
            for part in step.key.split("."):
                host = getattr(host, part)
            found[step.name] = host[0]
    return dict(found)


def engine_args(model_type: str) -> dict:
    """A small engine: 16 sequences, 64-token steps, a KV cache of 24 blocks of 32 tokens (too few for them all)."""
    config = tiny.config_kwargs(model_type)
    kv_heads = config.get("num_key_value_heads", config.get("num_attention_heads", 4))
    block_bytes = BLOCK * config["num_hidden_layers"] * 2 * kv_heads * 32 * 4
    return {
        "dtype": "float32",
        "max_model_len": 256,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 64,
        "block_size": BLOCK,
        "kv_cache_memory_bytes": 24 * block_bytes,
        "disable_log_stats": False,
    }


def greedy_generation(model, prompt: str, specs: list[Steering]) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and their logprobs with each spec applied by ``model.steer`` (the nnsight path).

    Step 0 is the prompt; steps after it feed a generated token back in.
    """
    if isinstance(model, StandardizedVLLM):
        settings = {"max_tokens": STEPS, "temperature": 0.0, "ignore_eos": True}
    else:
        settings = {"max_new_tokens": STEPS, "do_sample": False, "min_new_tokens": STEPS}
    plan = sorted((layer % model.num_layers, index) for index, spec in enumerate(specs) for layer in spec.layers)
    with model.generate(prompt, **settings) as tracer:
        probabilities = nnsight.save([])
        for step in tracer.iter[:STEPS]:
            for layer, index in plan:
                spec = specs[index]
                phase = "prompt" if step == 0 else "generated"
                if spec.positions in ("all", phase):
                    reference.intervene(model, layer, spec)
                elif step == 0 and not isinstance(spec.positions, str):
                    reference.intervene(model, layer, spec, spec.positions)
            probabilities.append(model.next_token_probs)
    rows = torch.cat([p.reshape(1, -1) for p in probabilities]).float()
    tokens = rows.argmax(-1)
    return tokens.tolist(), rows.gather(1, tokens[:, None])[:, 0].log()


def tokens_and_logprobs(output) -> tuple[list[int], torch.Tensor]:
    completion = output.outputs[0]
    tokens = list(completion.token_ids)
    return tokens, torch.tensor([step[token].logprob for step, token in zip(completion.logprobs, tokens)])


def teacher_forced(model, prompt_ids: list[int], generated: list[int], add: torch.Tensor | None, positions: list[int]):
    """One forward of prompt + generated tokens (each generated token fed in as it would be) with ``add``
    steered into block 1's output at ``positions``: the logprobs of the generated tokens, and that output."""
    with model.trace({"prompt_token_ids": prompt_ids + generated[:-1]}):
        if add is not None:
            model.steer(1, add, positions=positions)
        stream = model.layers[1].layer_output.save()
        logits = model.logits.save()
    predicting = torch.log_softmax(logits[0, len(prompt_ids) - 1 :].float(), -1)
    return predicting.gather(1, torch.tensor(generated)[:, None])[:, 0], stream[0]


def hooked_ablation(path, prompt_ids: list[int], unit: torch.Tensor) -> list[int]:
    """Greedy tokens of transformers' own model with ``unit`` taken out of the first block's input and of every
    attention's and MLP's output by forward hooks (no project code)."""
    model = reference.load(path)

    def removed(stream: torch.Tensor) -> torch.Tensor:
        return stream - (stream @ unit)[..., None] * unit

    def first_input(module, args, kwargs):
        if args:
            return (removed(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": removed(kwargs["hidden_states"])}

    def output(module, args, out):
        return (removed(out[0]), *out[1:]) if isinstance(out, tuple) else removed(out)

    blocks = reference.blocks(model)
    handles = [blocks[0].register_forward_pre_hook(first_input, with_kwargs=True)]
    for block in blocks:
        attention = getattr(block, "self_attn", None) or block.attn
        handles += [attention.register_forward_hook(output), block.mlp.register_forward_hook(output)]
    try:
        with torch.no_grad():
            generated = model.generate(
                torch.tensor([prompt_ids]), max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False
            )
    finally:
        for handle in handles:
            handle.remove()
    return generated[0, len(prompt_ids) :].tolist()


def hooked_generation(path, prompt_ids: list[int], specs, saelens: dict) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and their logprobs of transformers' own model with ``specs`` applied by forward hooks at each
    block's output (no project code): added vectors first, then each cap and SAE-feature clamp in order, the
    feature's activation by SAELens's own ``encode`` (``saelens``: its SAE objects by directory) and its decoder
    contribution by SAELens's ``decode``. The first call of a block is the prompt; each later one a generated token."""
    model = reference.load(path)
    calls: dict[int, int] = {}

    def hook(layer: int):
        def edit(module, args, out):
            stream = (out[0] if isinstance(out, tuple) else out).clone()
            step = calls.get(layer, 0)
            calls[layer] = step + 1
            phase = "prompt" if step == 0 else "generated"
            ordered = sorted(specs, key=lambda spec: not isinstance(spec, Steering))
            for spec in ordered:
                if layer not in [chosen % model.config.num_hidden_layers for chosen in spec.layers]:
                    continue
                if spec.positions in ("all", phase):
                    at = list(range(stream.shape[1]))
                elif phase == "prompt" and not isinstance(spec.positions, str):
                    at = sorted({position % stream.shape[1] for position in spec.positions})
                else:
                    continue
                h = stream[0, at]
                if isinstance(spec, Steering):
                    h = h + spec.factor * spec.vector
                elif isinstance(spec, Cap):
                    projection = h @ spec.vector
                    h = h + (projection.clamp(spec.min, spec.max) - projection)[:, None] * spec.vector
                else:
                    sae = saelens[spec.sae.path]
                    active = sae.encode(h)[:, spec.feature]
                    target = active * spec.scale if spec.value is None else torch.full_like(active, spec.value)
                    unit = torch.zeros(sae.cfg.d_sae)
                    unit[spec.feature] = 1.0
                    row = sae.decode(unit[None])[0] - sae.decode(torch.zeros(1, sae.cfg.d_sae))[0]
                    h = h + (target - active)[:, None] * row
                stream[0, at] = h
            return (stream, *out[1:]) if isinstance(out, tuple) else stream

        return edit

    handles = [block.register_forward_hook(hook(i)) for i, block in enumerate(reference.blocks(model))]
    return reference.greedy_with_hooks(model, prompt_ids, handles, STEPS)


def metric(model: LLM, name: str) -> float:
    return sum(m.value for m in model.get_metrics() if m.name == name)


LONG_PROMPT = "Steering keys the prefix cache: " + "every block of these tokens. " * 5
DECODE_PROMPT = "Steering the answer alone shares the question: " + "block by block. " * 4
OTHER_LONG_PROMPT = "The reverse order shares nothing: " + "block after block of them. " * 5


#: The size of an element of the tiny models' residual stream, which the seeded SAEs are built for.
STREAM_SCALE = 0.07
#: The SAEs each family's tests clamp: SAELens's three architectures, one per block, by the hook each reads.
SAES = {
    "standard": "blocks.0.hook_resid_post",
    "jumprelu": "blocks.2.hook_resid_pre",
    "topk": "blocks.2.hook_resid_post",
}


def held_saes(directory: Path, hidden_size: int) -> tuple[dict, dict]:
    """SAELens's SAEs of `SAES` saved in ``directory``, and ours loaded from them, by kind."""
    cfg = {"topk": {"k": 8, "rescale_acts_by_decoder_norm": True}}
    saelens = {
        kind: reference.saelens_sae(
            directory / kind, kind, hook, hidden_size, seed=3, stream_scale=STREAM_SCALE, **cfg.get(kind, {})
        )
        for kind, hook in SAES.items()
    }
    return saelens, {kind: SAE.load(directory / kind) for kind in SAES}


def steered_engine(path: Path, topk: SAE, model_type: str) -> SteeredVLLM:
    """The steered engine of these tests (every stream value kept, the TopK SAE of `held_saes` held, the small
    engine of `engine_args`). Other modules build theirs with it too: built alike, the engines compile one graph
    between them (each later one finds it in the compile cache)."""
    return SteeredVLLM(path, capture_values=KEPT, saes=[topk], **engine_args(model_type))


@pytest.fixture(scope="class", params=["llama", "gpt2"])
def family(request, tmp_path_factory):
    """References on plain vLLM, the nnsight path and transformers, then the steered engine (shut down after),
    holding the TopK SAE of `SAES` (built by SAELens)."""
    model_type = request.param
    path = tiny.checkpoint(model_type)
    hf = StandardizedTransformer(path)
    saelens, saes = held_saes(tmp_path_factory.mktemp(f"saes-{model_type}"), hf.hidden_size)
    batch = cases(hf.hidden_size, saes)
    prompts = [prompt for prompt, _ in batch]

    plain = LLM(str(path), **engine_args(model_type))
    try:
        plain_outputs = plain.generate(prompts + [LONG_PROMPT, OTHER_LONG_PROMPT], SamplingParams(**GREEDY))
    finally:
        shutdown_llm(plain)
    plain = [tokens_and_logprobs(output) for output in plain_outputs]

    nnsight_model = StandardizedVLLM(path, dtype="float32", dispatch=True, max_model_len=256)
    try:
        on_nnsight = {
            i: greedy_generation(nnsight_model, prompt, specs) for i, (prompt, specs) in enumerate(batch) if specs
        }
        phases = phase_oracle(nnsight_model, hf.hidden_size)
        kept_on_nnsight = {
            i: forced_values(
                nnsight_model,
                hf.tokenizer(prompt)["input_ids"],
                (on_nnsight[i] if specs else plain[i])[0],
                specs,
                capture_of(i).names(hf.num_layers),
            )
            for i, (prompt, specs) in enumerate(batch)
            if capture_of(i) is not None
        }
    finally:
        nnsight_model.shutdown()

    model = steered_engine(path, saes["topk"], model_type)
    try:
        yield SimpleNamespace(
            model_type=model_type,
            path=path,
            model=model,
            hf=hf,
            saes=saes,
            saelens=saelens,
            batch=batch,
            plain=plain,
            on_nnsight=on_nnsight,
            phases=phases,
            kept_on_nnsight=kept_on_nnsight,
        )
    finally:
        model.shutdown()


def phase_oracle(model: StandardizedVLLM, hidden_size: int) -> dict[str, SimpleNamespace]:
    """Per phase (``"prompt"``, ``"generated"``): a spec, the nnsight path's greedy tokens with it, and one
    forward over prompt + tokens with the vector added at that phase's positions, at the other phase's, or nowhere."""
    vector = torch.randn(hidden_size, generator=torch.Generator().manual_seed(11)) * 2
    found = {}
    for phase, prompt in (("prompt", SUBJECTS[0]), ("generated", SUBJECTS[1])):
        spec = Steering(1, vector, positions=phase)
        tokens, _ = greedy_generation(model, prompt, [spec])
        prompt_ids = model.tokenizer(prompt)["input_ids"]
        prompt_positions = list(range(len(prompt_ids)))
        generated_positions = list(range(len(prompt_ids), len(prompt_ids) + len(tokens) - 1))
        own, other = (prompt_positions, generated_positions)[:: 1 if phase == "prompt" else -1]
        found[phase] = SimpleNamespace(
            prompt=prompt,
            spec=spec,
            tokens=tokens,
            prompt_length=len(prompt_ids),
            own=teacher_forced(model, prompt_ids, tokens, vector, own),
            other=teacher_forced(model, prompt_ids, tokens, vector, other),
            unsteered=teacher_forced(model, prompt_ids, tokens, None, []),
        )
    return found


def kept_rows(capture: Capture, values: dict, prompt_length: int, fed: int) -> dict:
    """The rows ``capture`` keeps of values read at every position of ``fed`` tokens."""
    positions = phase_positions(capture.positions, prompt_length, fed)
    return {name: value[positions].to(capture.dtype or value.dtype) for name, value in values.items()}


class TestSteeredVLLM:
    def test_a_mixed_batch_equals_the_nnsight_path_and_transformers(self, family):
        """Captured, steered, captured-and-steered and plain requests in one batch that prefills in chunks, is
        preempted, and has requests join and leave: tokens and kept values equal each path's own."""
        model, batch = family.model, family.batch
        preemptions = metric(model, "vllm:num_preemptions")
        captures = [capture_of(i) for i in range(len(batch))]
        outputs = model.generate(
            [prompt for prompt, _ in batch], SamplingParams(**GREEDY), [s for _, s in batch], capture=captures
        )
        preempted = metric(model, "vllm:num_preemptions") - preemptions
        for i, (output, capture) in enumerate(zip(outputs, captures)):
            if capture is None:
                assert output.activations is None and output.outputs[0].activations is None
                continue
            prompt_length, generated = len(output.prompt_token_ids), list(output.outputs[0].token_ids)
            fed = prompt_length + len(generated) - 1
            names = capture.names(family.hf.num_layers)
            assert list(output.activations) == names
            on_hf = forced_values(family.hf, output.prompt_token_ids, generated, batch[i][1], names)
            tolerance = KEPT_TOLERANCE[capture.dtype or torch.float32]
            for read in (family.kept_on_nnsight[i], on_hf):
                expected = kept_rows(capture, read, prompt_length, fed)
                for name in names:
                    torch.testing.assert_close(output.activations[name], expected[name], **tolerance, msg=name)
        for i, ((prompt, specs), output) in enumerate(zip(batch, outputs)):
            tokens, logprobs = tokens_and_logprobs(output)
            plain_tokens, plain_logprobs = family.plain[i]
            if specs is None:
                assert tokens == plain_tokens, (i, prompt)
                torch.testing.assert_close(logprobs, plain_logprobs, **LOGPROB_TOLERANCE)
                continue
            nnsight_tokens, nnsight_logprobs = family.on_nnsight[i]
            hf_tokens, hf_logprobs = greedy_generation(family.hf, prompt, specs)
            assert tokens == nnsight_tokens == hf_tokens, (i, specs)
            torch.testing.assert_close(logprobs, nnsight_logprobs, **LOGPROB_TOLERANCE)
            torch.testing.assert_close(logprobs, hf_logprobs, **LOGPROB_TOLERANCE)
            assert not torch.allclose(logprobs, plain_logprobs, atol=1e-3), (i, "steering changed nothing")
        assert preempted > 0, "the batch was meant to be preempted"
        assert max(len(output.prompt_token_ids) for output in outputs) > 64 > 16  # chunked prefill; joins

    def test_ablation_and_capping_hold_at_every_position_they_name(self, family):
        """Each kept stream leaving a block holds no ablated direction and a capped projection within its bounds,
        on the prompt and on every generated token, in one batch beside added and plain requests."""
        generator = torch.Generator().manual_seed(19)
        ablated, capped, added = (torch.randn(family.hf.hidden_size, generator=generator) for _ in range(3))
        capped -= (capped @ ablated) / (ablated @ ablated) * ablated  # orthogonal: capping keeps the ablation
        layers = list(range(family.hf.num_layers))
        requests = [
            [Steering(1, added, factor=3.0), Ablate(ablated, layers), Cap(capped, layers=[0, 2], min=0.5, max=0.8)],
            [Steering(1, added, factor=3.0)],
            None,
        ]
        outputs = family.model.generate(
            [SUBJECTS[4]] * 3, SamplingParams(**GREEDY), requests, capture=Capture("layers.*.layer_output")
        )
        unit, cap_unit = ablated / ablated.norm(), capped / capped.norm()
        streams = [torch.stack([output.activations[f"layers.{i}.layer_output"] for i in layers]) for output in outputs]
        assert streams[0].shape[1] == len(outputs[0].prompt_token_ids) + STEPS - 1
        torch.testing.assert_close(streams[0] @ unit, torch.zeros(streams[0].shape[:2]), atol=1e-4, rtol=0)
        projection = streams[0][[0, 2]] @ cap_unit
        assert ((projection >= 0.5 - 1e-4) & (projection <= 0.8 + 1e-4)).all()
        for other in streams[1:]:
            assert (other @ unit).abs().max() > 1e-2 and ((other[[0, 2]] @ cap_unit) < 0.5).any()

    def test_ablation_everywhere_equals_hooks_at_every_contribution(self, family):
        """``Ablate(vector)`` (every residual-stream location) beside added and plain requests: no kept stream
        value carries the direction, and the tokens are those of transformers' own model with the direction
        taken out of the first block's input and of every attention's and MLP's output by forward hooks, and
        those of ``model.ablate("all", ...)`` in a trace on transformers."""
        generator = torch.Generator().manual_seed(29)
        direction, added = (torch.randn(family.hf.hidden_size, generator=generator) * 3 for _ in range(2))
        unit = direction / direction.norm()
        prompt = SUBJECTS[3]
        streams = ["layers.*.layer_input", "layers.*.attention_output", "layers.*.mlp_output", "layers.*.layer_output"]
        outputs = family.model.generate(
            [prompt] * 3,
            SamplingParams(**GREEDY),
            [Ablate(direction), Steering(1, added), None],
            capture=[Capture(streams), None, None],
        )
        assert len(outputs[0].activations) == 4 * family.hf.num_layers
        for name, rows in outputs[0].activations.items():
            torch.testing.assert_close(rows @ unit, torch.zeros(len(rows)), atol=1e-4, rtol=0, msg=name)
        tokens, _ = tokens_and_logprobs(outputs[0])
        prompt_ids = list(outputs[0].prompt_token_ids)
        assert tokens == hooked_ablation(family.path, prompt_ids, unit)
        with family.hf.generate(prompt_ids, max_new_tokens=STEPS, do_sample=False, min_new_tokens=STEPS) as tracer:
            for _ in tracer.iter[:STEPS]:
                family.hf.ablate("all", direction)
            result = tracer.result.save()
        assert result[0, len(prompt_ids) :].tolist() == tokens
        plain_tokens, _ = tokens_and_logprobs(outputs[2])
        kept = family.model.generate([prompt], SamplingParams(**GREEDY), None, capture=Capture(streams))[0]
        assert max((rows @ unit).abs().max() for rows in kept.activations.values()) > 1e-2  # the plain stream has it
        assert tokens_and_logprobs(kept)[0] == plain_tokens

    def test_sae_feature_clamps_equal_hooks_with_saelens_own_encoder(self, family):
        """Clamps of standard, JumpReLU and TopK SAE features (set, scaled, at every position form) beside added,
        capped and plain requests in one batch: the tokens and logprobs of transformers' own model with the same
        done by forward hooks and SAELens's ``encode``."""
        saes = family.saes
        generator = torch.Generator().manual_seed(37)
        added, capped = (torch.randn(family.hf.hidden_size, generator=generator) * 2 for _ in range(2))
        requests = [
            [Clamp(saes["standard"], 5, value=6.0)],
            [Clamp(saes["jumprelu"], 9, scale=0.0, positions="prompt"), Steering(1, added)],
            [Clamp(saes["topk"], 2, value=4.0, positions="generated"), Cap(capped, layers=2, max=0.5)],
            None,
            [Steering(0, added)],
            [Clamp(saes["standard"], 7, scale=3.0, positions=[0, -1]), Clamp(saes["standard"], 5, value=2.0)],
            [Clamp(saes["topk"], 11, scale=4.0), Clamp(saes["jumprelu"], 3, value=5.0)],
        ]
        prompts = [SUBJECTS[i % 5] for i in range(len(requests))] + SUBJECTS
        outputs = family.model.generate(prompts, SamplingParams(**GREEDY), requests + [None] * len(SUBJECTS))
        saelens = {saes[kind].path: family.saelens[kind] for kind in saes}
        for i, (specs, output) in enumerate(zip(requests, outputs)):
            tokens, logprobs = tokens_and_logprobs(output)
            if specs is None:
                continue
            prompt_ids = list(output.prompt_token_ids)
            hooked_tokens, hooked_logprobs = hooked_generation(family.path, prompt_ids, specs, saelens)
            assert tokens == hooked_tokens, specs
            torch.testing.assert_close(logprobs, hooked_logprobs, **LOGPROB_TOLERANCE)
            _, plain_logprobs = tokens_and_logprobs(outputs[len(requests) + i % 5])
            assert not torch.allclose(logprobs, plain_logprobs, atol=1e-3), (i, "the clamp changed nothing")

    def test_sae_features_captured_equal_saelens_encode_of_transformers_stream(self, family):
        """The held TopK SAE's features, captured as each token's top k and as chosen features densely (beside the
        block's own rows and a plain request), equal SAELens's ``encode`` of transformers' stream leaving block 2."""
        chosen = [1, 5, 9, 33]
        captures = [
            Capture(["layers.2.sae_features", "layers.1.layer_output"], top_k=5),
            Capture("layers.2.sae_features", positions="prompt", features=chosen),
            None,
        ]
        outputs = family.model.generate(SUBJECTS[:3], SamplingParams(**GREEDY), None, capture=captures)
        assert list(outputs[0].activations) == [
            "layers.1.layer_output",
            "layers.2.sae_features.indices",
            "layers.2.sae_features.values",
        ]
        assert list(outputs[1].activations) == ["layers.2.sae_features"] and outputs[2].activations is None
        saelens = family.saelens["topk"]
        model = reference.load(family.path)
        for output, capture in zip(outputs[:2], captures):
            fed = list(output.prompt_token_ids) + list(output.outputs[0].token_ids)[:-1]
            seen = reference.block_outputs(model, fed, [1, 2])
            with torch.no_grad():
                expected = saelens.encode(seen[2])
            kept = output.activations
            if capture.features is None:
                top = expected.topk(5, dim=-1)
                assert kept["layers.2.sae_features.indices"].shape == (len(fed), 5)
                active = top.values > 0  # where fewer are active, which zero comes first is arbitrary
                assert active[:, 0].float().mean() > 0.5, "most tokens should have an active feature"
                assert torch.equal(kept["layers.2.sae_features.indices"][active], top.indices[active])
                torch.testing.assert_close(kept["layers.2.sae_features.values"], top.values, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(kept["layers.1.layer_output"], seen[1], atol=1e-4, rtol=1e-4)
            else:
                prompt = expected[: len(output.prompt_token_ids), chosen]
                torch.testing.assert_close(kept["layers.2.sae_features"], prompt, atol=1e-4, rtol=1e-4)
                assert (prompt > 0).any(), "the chosen features should fire somewhere on the prompt"

    def test_sae_features_the_engine_cannot_encode_are_refused_before_it_runs(self, family):
        requests = family.model.request_counter.counter
        params = SamplingParams(**GREEDY)
        with pytest.raises(
            ValueError,
            match=r"layers.1.sae_features needs an SAE reading block 1's output; the engine holds topk at block 2",
        ):
            family.model.generate(SUBJECTS[0], params, capture=Capture("layers.1.sae_features"))
        with pytest.raises(ValueError, match=r"features \[64\] do not exist in SAE 'topk' \(64 features, 0..63\)"):
            family.model.generate(SUBJECTS[0], params, capture=Capture("layers.2.sae_features", features=[3, 64]))
        assert family.model.request_counter.counter == requests
        with pytest.raises(ValueError, match="top_k must be an int >= 1, got 0"):
            Capture("layers.2.sae_features", top_k=0)
        with pytest.raises(ValueError, match=r"layers.2.sae_features is encoded by the SAE .* blocks none: add"):
            SteeredVLLM(family.path, capture_values=["layers.2.sae_features"])
        # An engine asked to keep an SAE's features keeps what they are encoded from: the block's output.
        held = [family.saes["topk"]]
        kept = kept_values(["layers.2.sae_features", "layers.0.layer_output"], family.hf.num_layers, {}, held)
        assert kept == ["layers.0.layer_output", "layers.2.layer_output"]

    def test_a_topk_feature_the_engine_does_not_hold_is_refused_before_it_runs(self, family, tmp_path):
        reference.saelens_sae(tmp_path / "other", "topk", "blocks.1.hook_resid_post", family.hf.hidden_size, k=4)
        requests = family.model.request_counter.counter
        with pytest.raises(
            ValueError, match=r"is a TopK SAE, .* build the engine with saes=\[...\] naming it \(it holds \['topk'\]\)"
        ):
            family.model.generate(SUBJECTS[0], SamplingParams(**GREEDY), Clamp(tmp_path / "other", 1, value=2.0))
        assert family.model.request_counter.counter == requests
        assert list(family.model.saes) == ["topk"]

    def test_ablation_everywhere_on_a_model_that_cannot_write_a_location_is_refused_before_the_engine(self, family):
        model = family.model
        requests = model.request_counter.counter
        held = dict(model.unwritable)
        model.unwritable = {**held, "mlp_output": "this family cannot write layers.0.mlp_output: it is read-only there"}
        try:
            with pytest.raises(ValueError, match=r"Ablate: layers='all' .* is not served on this model: this family"):
                model.generate(SUBJECTS[0], SamplingParams(**GREEDY), Ablate(torch.ones(family.hf.hidden_size)))
        finally:
            model.unwritable = held
        assert model.request_counter.counter == requests

    def test_the_steering_runs_inside_the_compiled_graph(self, family):
        model = family.model
        assert model.llm_engine.vllm_config.compilation_config.mode.name != "NONE"
        (before,) = model.steering_stats()
        vector = torch.randn(family.hf.hidden_size, generator=torch.Generator().manual_seed(5))
        for factor in (1.0, 2.0, 3.0):  # new vectors, new rows: the same compiled graph
            model.generate(SUBJECTS[2], SamplingParams(**GREEDY), Steering(1, vector, factor=factor))
        (after,) = model.steering_stats()
        # No run outside the compiled graph: only a step clamping a TopK SAE's feature runs eagerly (earlier tests).
        assert after["eager_calls"] == before["eager_calls"]
        assert after["compilation"] == before["compilation"]
        assert after["dynamo_unique_graphs"] == before["dynamo_unique_graphs"]
        assert after["entry_writes"] >= before["entry_writes"] + 3

    def test_the_prefix_cache_is_keyed_by_the_steering(self, family):
        model = family.model
        params = SamplingParams(**{**GREEDY, "max_tokens": 8})
        generator = torch.Generator().manual_seed(13)
        first, second = (Steering(0, torch.randn(family.hf.hidden_size, generator=generator)) for _ in range(2))
        plain_long, plain_other = (tokens[:8] for tokens, _ in family.plain[-2:])

        def run(prompt, steering=None):
            """Greedy tokens and prefix-cache hits (vLLM's counter, and the request's own count) of one request."""
            hits = metric(model, "vllm:prefix_cache_hits")
            (output,) = model.generate(prompt, params, steering)
            assert metric(model, "vllm:prefix_cache_hits") - hits == output.num_cached_tokens
            return list(output.outputs[0].token_ids), output.num_cached_tokens

        blocks = {
            prompt: len(model.get_tokenizer()(prompt)["input_ids"]) // BLOCK * BLOCK
            for prompt in (LONG_PROMPT, OTHER_LONG_PROMPT)
        }
        shared, other_shared = blocks[LONG_PROMPT], blocks[OTHER_LONG_PROMPT]
        steered, cached = run(LONG_PROMPT, first)
        assert cached == 0
        assert run(LONG_PROMPT) == (plain_long, 0)  # blocks computed under a vector are not shared unsteered
        assert run(LONG_PROMPT) == (plain_long, shared)  # unsteered blocks are
        assert run(LONG_PROMPT, first) == (steered, shared)  # and so are those of identical steering
        other_steered, cached = run(LONG_PROMPT, second)
        assert cached == 0 and other_steered != steered
        assert run(OTHER_LONG_PROMPT) == (plain_other, 0)  # the reverse order: unsteered first
        cold, cached = run(OTHER_LONG_PROMPT, first)
        assert cached == 0 and cold != plain_other
        assert run(OTHER_LONG_PROMPT, first) == (cold, other_shared)

    def test_steering_of_generated_tokens_only_shares_the_prompt_and_caches_none_of_its_own(self, family):
        """Its prompt is computed as an unsteered request's: shared with those and with each other; the steered
        generated tokens' blocks stay out of the cache, where a prompt repeating them would read them."""
        model = family.model
        tokenizer = model.get_tokenizer()
        prompt = tokenizer(DECODE_PROMPT)["input_ids"]
        params = SamplingParams(**{**GREEDY, "max_tokens": 2 * BLOCK})
        spec = Steering(
            1,
            torch.randn(family.hf.hidden_size, generator=torch.Generator().manual_seed(17)) * 2,
            positions="generated",
        )

        def run(prompt_ids, steering=None):
            hits = metric(model, "vllm:prefix_cache_hits")
            (output,) = model.generate({"prompt_token_ids": prompt_ids}, params, steering)
            assert metric(model, "vllm:prefix_cache_hits") - hits == output.num_cached_tokens
            return list(output.outputs[0].token_ids), output.num_cached_tokens

        shared = len(prompt) // BLOCK * BLOCK
        steered, cached = run(prompt, spec)
        assert cached == 0
        assert run(prompt, spec) == (steered, shared)  # steered alike: the prompt is shared
        plain, cached = run(prompt)
        assert cached == shared and plain != steered  # and shared with unsteered requests
        assert run(prompt, spec) == (steered, shared)
        # A prompt repeating the steered generation reads the prompt's blocks only; the plain generation's are cached.
        assert run(prompt + steered)[1] == shared
        assert run(prompt + plain)[1] > shared

    @pytest.mark.parametrize("phase", ["prompt", "generated"])
    def test_positions_steer_only_their_phase(self, family, phase):
        oracle = family.phases[phase]
        (output,) = family.model.generate(oracle.prompt, SamplingParams(**GREEDY), oracle.spec)
        tokens, logprobs = tokens_and_logprobs(output)
        assert tokens == oracle.tokens
        # Read through StandardizedVLLM: the vector lands in the stream at the phase's positions only.
        length = oracle.prompt_length
        (own_logprobs, own_stream), (other_logprobs, _), (_, unsteered) = oracle.own, oracle.other, oracle.unsteered
        added = (own_stream - unsteered).norm(dim=-1)
        inside = torch.arange(len(added)) < length if phase == "prompt" else torch.arange(len(added)) >= length
        assert (added[inside] > 1).all() and (added[~inside] < 1e-5).all()
        # SteeredVLLM's logprobs are those of the stream steered at the phase's positions, not the other's.
        torch.testing.assert_close(logprobs, own_logprobs, **LOGPROB_TOLERANCE)
        assert not torch.allclose(logprobs, other_logprobs, atol=1e-3)

    @pytest.mark.parametrize(
        "make, message",
        [
            (lambda n: Steering("1", torch.zeros(n)), "layers must be an int"),
            (lambda n: Steering(1, torch.zeros(n, dtype=torch.int64)), "floating dtype"),
            (lambda n: Steering(1, torch.full((n,), float("nan"))), "NaN or inf"),
            (lambda n: Steering(1, ["a"] * n), "a non-empty list of floats"),
            (lambda n: Steering(1, torch.zeros(n), factor=float("inf")), "factor must be a finite number"),
            (lambda n: Steering(1, torch.zeros(n), positions="decode"), "positions must be"),
            (lambda n: [Steering(1, torch.zeros(7))], r"shape \[hidden_size\] = \[128\]"),
            (lambda n: [Steering(9, torch.zeros(n))], r"layer\(s\) \[9\] do not exist.*num_layers=3"),
            (lambda n: [Steering(1, torch.zeros(n), positions=[500])], r"position\(s\) \[500\] are outside"),
            (lambda n: Ablate(torch.zeros(n), layers=1), "nonzero, finite norm"),
            (lambda n: Cap(torch.ones(n), layers="all", max=1.0), r"layers='all' is served by Ablate only"),
            (lambda n: Cap(torch.ones(n), layers=1), "give min, max or both"),
            (lambda n: Cap(torch.ones(n), layers=1, min=1.0, max=-1.0), "min must not exceed max"),
            (lambda n: [Cap(torch.ones(7), layers=1, max=1.0)], r"Cap: the vector must have shape \[hidden_size\]"),
            (lambda n: [Ablate(torch.ones(n), layers=[0, 5])], r"Ablate: layer\(s\) \[5\] do not exist"),
            (
                lambda n: [Ablate(torch.randn(n), layers=[0, 1]) for _ in range(3)],
                r"specs \[0, 1, 2\] cap, ablate or clamp 3 directions on the same tokens at layer 0",
            ),
        ],
    )
    def test_bad_specs_are_refused_before_the_engine_sees_them(self, family, make, message):
        model, hidden_size = family.model, family.hf.hidden_size
        requests = model.request_counter.counter
        with pytest.raises(ValueError, match=message):
            steering = make(hidden_size)  # what needs no model is refused as the spec is made
            model.generate([SUBJECTS[0], SUBJECTS[1]], SamplingParams(**GREEDY), [None, steering])
        assert model.request_counter.counter == requests
        assert model.llm_engine.get_num_unfinished_requests() == 0
        (output,) = model.generate(SUBJECTS[3], SamplingParams(**GREEDY))
        assert len(output.outputs[0].token_ids) == STEPS

    def test_capture_runs_inside_the_compiled_graph(self, family):
        model = family.model
        (before,) = model.capture_stats()
        (steering_before,) = model.steering_stats()
        vector = torch.randn(family.hf.hidden_size, generator=torch.Generator().manual_seed(5))
        for capture in CAPTURES[:3]:  # other values and positions each time: the same compiled graph
            (output,) = model.generate(SUBJECTS[2], SamplingParams(**GREEDY), Steering(1, vector), capture=capture)
            assert list(output.activations) == capture.names(family.hf.num_layers)
        (after,) = model.capture_stats()
        (steering_after,) = model.steering_stats()
        assert after["eager_calls"] == before["eager_calls"]  # (earlier steps clamping a TopK feature ran eagerly)
        assert after["rows_kept"] > before["rows_kept"]
        assert steering_after["compilation"] == steering_before["compilation"]
        assert steering_after["dynamo_unique_graphs"] == steering_before["dynamo_unique_graphs"]
        assert after["finished_held"] == 0  # every request's rows went to its output

    def test_captured_prompts_are_computed_and_plain_ones_keep_sharing_the_cache(self, family):
        model = family.model
        params = SamplingParams(**{**GREEDY, "max_tokens": 4})
        capture = Capture(["layers.*.layer_output", "token_embeddings"])
        shared = len(model.get_tokenizer()(LONG_PROMPT)["input_ids"]) // BLOCK * BLOCK

        def run(capture=None):
            hits = metric(model, "vllm:prefix_cache_hits")
            (output,) = model.generate(LONG_PROMPT, params, capture=capture)
            assert metric(model, "vllm:prefix_cache_hits") - hits == output.num_cached_tokens
            return output

        model.generate(LONG_PROMPT, params)  # the prompt's blocks are in the cache
        first = run(capture)
        plain = run()
        second = run(capture)
        assert first.num_cached_tokens == second.num_cached_tokens == 0  # computed, not served from cache
        assert plain.num_cached_tokens == shared > 0  # an uncaptured request keeps sharing
        for name, rows in first.activations.items():
            assert torch.equal(rows, second.activations[name]), name
        # Positions vLLM computes anyway (the prompt's last token, generated ones) may read the cache.
        last = run(Capture("layers.1.layer_output", positions="last"))
        assert last.num_cached_tokens == shared
        torch.testing.assert_close(
            last.activations["layers.1.layer_output"],
            first.activations["layers.1.layer_output"][len(first.prompt_token_ids) - 1 : len(first.prompt_token_ids)],
            **KEPT_TOLERANCE[torch.float32],
        )

    @pytest.mark.parametrize(
        "make, error, message",
        [
            (
                lambda: Capture("layers.1.self_attn.attention_probabilities"),
                ValueError,
                "not kept by the engine.*nnsight",
            ),
            (lambda: Capture("logits"), ValueError, "not kept by the engine"),
            (lambda: Capture("layers.x.layer_output"), ValueError, "the layer part 'x' is not"),
            (lambda: Capture([]), ValueError, "non-empty list"),
            (lambda: Capture(7), TypeError, "values is a selector"),
            (lambda: Capture("layers.1.layer_output", positions="middle"), ValueError, "'last'.*got 'middle'"),
            (lambda: Capture("layers.1.layer_output", dtype="int8"), ValueError, "floating torch dtype"),
            (lambda: [None, Capture("layers.7.layer_output")], ValueError, r"layer\(s\) \[7\] do not exist"),
            (lambda: [None, Capture("layers.1.layer_output", positions=[99])], ValueError, r"position\(s\) \[99\]"),
            (lambda: [Capture("layers.1.layer_output")] * 3, ValueError, "3 entries for 2 prompts"),
            (lambda: {"values": "layers.1.layer_output"}, TypeError, "capture is None, a Capture"),
        ],
    )
    def test_bad_captures_are_refused_before_the_engine_sees_them(self, family, make, error, message):
        model = family.model
        requests = model.request_counter.counter
        with pytest.raises(error, match=message):
            model.generate([SUBJECTS[0], SUBJECTS[1]], SamplingParams(**GREEDY), capture=make())
        assert model.request_counter.counter == requests
        assert model.llm_engine.get_num_unfinished_requests() == 0
        (output,) = model.generate(SUBJECTS[3], SamplingParams(**GREEDY), capture=CAPTURES[0])
        assert output.activations["layers.0.layer_output"].shape[0] == len(output.prompt_token_ids) + STEPS - 1

    def test_a_capture_keeping_more_than_one_completion_is_refused(self, family):
        with pytest.raises(ValueError, match="one completion \\(n=1\\), not n=2"):
            family.model.generate(SUBJECTS[0], SamplingParams(n=2, temperature=1.0, max_tokens=4), capture=CAPTURES[0])

    def test_a_rendered_prompt_without_tokens_is_refused(self, family):
        spec = Steering(0, torch.zeros(family.hf.hidden_size))
        with pytest.raises(ValueError, match="cannot steer a prompt of type 'embeds'"):
            family.model.steered_request({"type": "embeds"}, SamplingParams(), [spec])


def test_what_the_steered_engine_cannot_serve_is_refused_before_it_loads():
    path = tiny.checkpoint("llama")
    refused = [
        ({"worker_cls": "my.Worker"}, "worker_cls is refused"),
        ({"speculative_config": {"method": "ngram"}}, "speculative decoding is not supported"),
        ({"pipeline_parallel_size": 2}, "pipeline parallelism is not supported"),
        ({"max_steering_entries": -1}, "max_steering_entries must be an int >= 0"),
        ({"steering_directions_per_block": 0}, "steering_directions_per_block must be an int >= 1"),
        ({"steering_values": ["mlp_output"]}, "steering_values must hold 'layer_output'"),
        ({"steering_values": ["layer_output", "logits"]}, r"'logits' is not a value the steering operation acts at"),
        ({"steering_values": "layer_output"}, "steering_values is a list of value names"),
        ({"enable_dbo": True}, r"enable_dbo is refused .*True.* \(dual batch overlap\) is not supported"),
        ({"ubatch_size": 2}, r"ubatch_size is refused .*2.* micro-batching \(ubatch_size > 1\) is not supported"),
        ({"capture_values": "layers.1.self_attn.attention_queries"}, "capture_values: .* is not kept by the engine"),
        ({"capture_values": "layers.3.layer_output"}, r"layer\(s\) \[3\] do not exist"),
        (
            {"capture_values": "layers.2.layer_output", "additional_config": {FIRST_BLOCKS: 2}},
            "layers.2.layer_output lie after the 2 blocks this engine runs",
        ),
    ]
    for kwargs, message in refused:
        with pytest.raises(ValueError, match=message):
            SteeredVLLM(path, **kwargs)
    with pytest.raises(UnsupportedFamily, match="model_type 'codegen' is not served on vLLM: no vLLM architecture"):
        SteeredVLLM(tiny.checkpoint("codegen"))


def test_an_engine_that_has_not_said_where_it_acts_refuses_ablation_everywhere():
    """An `AsyncSteeredVLLM` whose ``check_capture_values`` has not run yet refuses ``Ablate(..., layers="all")``
    rather than sending a request whose ablation no hook would apply."""
    from nnterp_vllm.engines.steered.client import SteeringClient

    with pytest.raises(ValueError, match=r"layers='all' .* not served on this model: .*call check_capture_values"):
        SteeringClient().steered_request({"prompt_token_ids": [1, 2]}, SamplingParams(), [Ablate(torch.ones(8))])


def test_steering_for_generate_is_read_per_prompt_or_for_all():
    one, two = (Steering(0, [1.0, 2.0]) for _ in range(2))
    assert per_prompt(None, 3) == [[], [], []]
    assert per_prompt(one, 2) == [[one], [one]]
    assert per_prompt([one, two], 3) == [[one, two]] * 3  # a list of specs for every prompt
    assert per_prompt([one, None, [one, two]], 3) == [[one], [], [one, two]]  # as long as the prompts: per prompt
    with pytest.raises(TypeError, match=r"None, a Steering \(or Cap, Ablate, Clamp, Patch\) or a list of them"):
        per_prompt({"layers": 0}, 2)


def test_importing_the_specs_loads_no_vllm():
    code = (
        "import sys, torch\nfrom nnterp_vllm import Capture, Steering\nSteering(1, [0.5, 1.0], positions=[-1])\n"
        "Capture(['layers.*.layer_output', 'layers.2.attention_input'], positions='last', dtype='float16')\n"
        "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.scale
def test_async_generate_on_two_tensor_parallel_ranks():
    """AsyncSteeredVLLM (the serving engine) with tensor_parallel_size=2: every rank holds the vectors, the first
    keeps the captured rows (the streams are whole on every rank), and its threads are placed on CPUs of its own
    without VLLM_CPU_OMP_THREADS_BIND.

    Eager (``enforce_eager``), so the two ranks need not compile: the compiled path is the one above,
    and the steering and capture operations are the same code either way."""
    import asyncio

    from vllm.engine.arg_utils import AsyncEngineArgs

    from nnterp_vllm import AsyncSteeredVLLM

    path = tiny.checkpoint("llama")
    hf = StandardizedTransformer(path)
    vector = torch.randn(hf.hidden_size, generator=torch.Generator().manual_seed(3)) * 2
    requests = [
        (SUBJECTS[0], [Steering(1, vector, positions="prompt"), Steering(2, vector, factor=-1.0)], CAPTURES[0]),
        (SUBJECTS[1], None, CAPTURES[1]),
        (SUBJECTS[2], Steering([0, 2], vector, factor=0.5, positions=[-1]), None),
    ]
    arguments = AsyncEngineArgs(
        model=str(path), dtype="float32", max_model_len=256, tensor_parallel_size=2, enforce_eager=True
    )
    engine = AsyncSteeredVLLM.from_engine_args(arguments, capture_values=KEPT)

    async def one(i, prompt, steering, capture):
        params = SamplingParams(**GREEDY)
        async for output in engine.generate(prompt, params, f"request-{i}", steering=steering, capture=capture):
            final = output
        return final

    async def all_requests():
        return await asyncio.gather(*(one(i, *request) for i, request in enumerate(requests)))

    try:
        outputs = asyncio.run(all_requests())
    finally:
        engine.shutdown()
    for (prompt, steering, capture), output in zip(requests, outputs):
        tokens, logprobs = tokens_and_logprobs(output)
        hf_tokens, hf_logprobs = greedy_generation(hf, prompt, specs_of(steering))
        assert tokens == hf_tokens
        torch.testing.assert_close(logprobs, hf_logprobs, **LOGPROB_TOLERANCE)
        if capture is None:
            continue
        names = capture.names(hf.num_layers)
        on_hf = forced_values(hf, output.prompt_token_ids, tokens, specs_of(steering), names)
        fed = len(output.prompt_token_ids) + len(tokens) - 1
        expected = kept_rows(capture, on_hf, len(output.prompt_token_ids), fed)
        assert list(output.activations) == names
        for name in names:
            torch.testing.assert_close(output.activations[name], expected[name], **KEPT_TOLERANCE[torch.float32])
