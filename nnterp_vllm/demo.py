"""The demo on the embedded default model (SmolLM2-135M): values, the logit lens and steering."""

from __future__ import annotations

from .checkpoints import smollm2
from .engines.transformers import StandardizedTransformer

PROMPT = "The Eiffel Tower is in the city of"


def main() -> None:
    path = smollm2()
    model = StandardizedTransformer(path)
    print(f"model: {path} ({model.family.__name__}, {model.num_layers} layers, hidden {model.hidden_size})")
    with model.trace(PROMPT):
        pattern = model.layers[10].self_attn.attention_probabilities.save()
        resid = model.layers[10].layer_output.save()
        probs = model.next_token_probs.save()
    top = probs[0].topk(5)
    pairs = zip(top.indices.tolist(), top.values.tolist())
    print("next token:", [(model.tokenizer.decode(i), round(p, 3)) for i, p in pairs])
    print("layer 10 residual", tuple(resid.shape), "attention pattern", tuple(pattern.shape))
    lens = model.logit_lens(PROMPT)[0]
    print("logit lens, top token per layer:", [model.tokenizer.decode(i) for i in lens.argmax(-1).tolist()])
    direction = model.lm_head._module.weight[model.tokenizer.encode(" London")[0]].detach()
    with model.trace(PROMPT):
        model.steer(range(10, 20), direction / direction.norm(), factor=40.0)
        steered = model.next_token_probs.save()
    print("steered towards ' London':", model.tokenizer.decode(steered[0].argmax()), round(steered[0].max().item(), 3))


if __name__ == "__main__":
    main()
