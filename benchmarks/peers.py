"""Two peer tools harvesting the residual stream of every block of a checkpoint with vLLM, rows kept in memory.

``vllm_lens_harvest``: vllm-lens, a vLLM plugin. Its documented offline API: ``LLM.generate`` with
``SamplingParams(extra_args={"output_residual_stream": [layers]})``; each ``RequestOutput`` comes back with
``.activations["residual_stream"]``, ``(n_layers, n_positions, hidden)``. It forces ``enforce_eager=True`` (its
hooks need the Python forward) and vLLM's V1 model runner on every engine it sees, which is how it runs here.

``interp_engine_harvest``: interp-engine's hooked vLLM backend, ``load_model(checkpoint, backend="vllm")``, then
its async ``capture(token_ids, ["resid_post.<i>", ...])`` per row, the rows in flight together (what its
synchronous ``capture`` does for a batch). Its engine is vLLM's ``AsyncLLM``, whose core always runs in a process
of its own; it builds it with ``enforce_eager=True``.

Both take the same settings as our harvest's engine (fp32, ``enable_prefix_caching=False``,
``max_num_batched_tokens=2048``, the CPU build's KV cache sized by `engine_kwargs`), prefill only (``max_tokens=1``).
Each function returns tokens, wall seconds and CPU seconds of the harvest alone (the engine build excluded; CPU:
this process and every process under it, the engine core included while it runs). `install` puts both packages,
pinned and without their dependencies, into a side directory for ``sys.path`` (vllm-lens declares Python >= 3.12
and vLLM 0.30, interp-engine vLLM 0.28; neither is installed into the environment).

    python benchmarks/peers.py [--peer vllm-lens|interp-engine] [--documents 8] [--tokens 60]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VERSIONS = {"vllm-lens": "1.3.0", "interp-engine": "1.14.2"}
#: The harvest engine's scheduler settings (``nnterp_vllm.harvest.in_engine.ENGINE_DEFAULTS``).
ENGINE_SETTINGS = {"dtype": "float32", "enable_prefix_caching": False, "max_num_batched_tokens": 2048}
CORPUS = Path(__file__).resolve().parent.parent / "nnterp_vllm" / "data" / "corpus.jsonl"
#: vllm-lens's kill switch: its plugin loads in every vLLM process of an environment that has it, and would
#: otherwise force eager mode and its worker extension on interp-engine's engine too.
VLLM_LENS_DISABLE = "VLLM_LENS_DISABLE"


def install(cache: Path) -> Path:
    """Both peers, pinned, ``--no-deps`` and ``--ignore-requires-python``, in ``cache/peers-<versions>`` (once);
    the directory to put on ``sys.path``."""
    target = Path(cache) / ("peers-" + "-".join(f"{name}-{version}" for name, version in VERSIONS.items()))
    if (target / ".installed").exists():
        return target
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--ignore-requires-python"]
    command += ["--upgrade", "--target", str(target), *(f"{name}=={version}" for name, version in VERSIONS.items())]
    subprocess.run(command, check=True)
    (target / ".installed").touch()
    return target


def cpu_seconds() -> float:
    """CPU seconds, user and system, of this process and every process under it: the reaped ones
    (``RUSAGE_CHILDREN``) and the ones still running (an engine core and its worker), read from /proc."""
    import psutil

    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


def kv_cache_settings(checkpoint: str) -> dict:
    """The KV-cache settings our engines get on vLLM's CPU build (`engine_kwargs`), nothing else: the peers
    keep their own executor. Empty off the CPU build.

    Asked of `engine_kwargs` in a process of its own: it imports nnsight, which mounts ``save`` on every
    object, and vLLM then refuses any worker extension (vllm-lens's, interp-engine's) as clashing with the worker's
    own ``save``; the peers' processes stay without nnsight."""
    script = (
        "import json, sys\n"
        "from nnterp_vllm.engines.engine_defaults import engine_kwargs\n"
        "built = engine_kwargs(sys.argv[1], **json.loads(sys.argv[2]))\n"
        "print(json.dumps({k: built[k] for k in ('kv_cache_memory_bytes', 'max_model_len') if k in built}))\n"
    )
    root = str(Path(__file__).resolve().parent.parent)
    done = subprocess.run(
        [sys.executable, "-c", script, checkpoint, json.dumps(ENGINE_SETTINGS)],
        check=True,
        capture_output=True,
        text=True,
        cwd=root,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def refuse_nnsight(peer: str) -> None:
    """Raise where nnsight is imported in this process: it mounts ``save`` on every object, and vLLM then
    refuses the peer's worker extension (its check finds ``save`` on the worker class already)."""
    if "nnsight" in sys.modules and hasattr(object, "save"):
        raise RuntimeError(
            f"{peer} cannot run in a process that imported nnsight (nnsight mounts .save() on every object, and "
            "vLLM refuses a worker extension whose attributes the worker class already has); run it in a process "
            "of its own without importing nnterp_vllm.engines"
        )


def _checked(name: str, per_layer: list[int], expected: int, layers: int) -> None:
    """Raise unless the peer returned ``expected`` rows at each of ``layers`` layers."""
    if len(per_layer) != layers or any(count != expected for count in per_layer):
        raise RuntimeError(f"{name} returned {per_layer} rows per layer; expected {expected} at each of {layers}")


def _layers(checkpoint: str) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(checkpoint).get_text_config().num_hidden_layers)


def vllm_lens_harvest(checkpoint: str, rows: list[list[int]]) -> dict:
    """vllm-lens capturing every block's residual stream (``model.layers.i`` output) of ``rows``, kept in memory;
    tokens, wall seconds and CPU seconds of the harvest (not the engine build)."""
    os.environ.pop(VLLM_LENS_DISABLE, None)
    import vllm_lens  # noqa: F401  (fails here, not inside vLLM's plugin loader, where it is missing)
    from vllm import LLM, SamplingParams

    from nnterp_vllm.engines.lifecycle import shutdown_llm

    refuse_nnsight("vllm-lens")
    layers = _layers(checkpoint)
    llm = LLM(checkpoint, **ENGINE_SETTINGS, **kv_cache_settings(checkpoint))
    try:
        if not hasattr(llm, "collect_hook_results"):
            raise RuntimeError("vllm-lens's vLLM plugin did not load (vllm.general_plugins entry point not found)")
        prompts = [{"prompt_token_ids": list(row)} for row in rows]
        params = SamplingParams(
            max_tokens=1, temperature=0.0, detokenize=False, extra_args={"output_residual_stream": list(range(layers))}
        )
        began, cpu = time.perf_counter(), cpu_seconds()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        kept = [output.activations["residual_stream"] for output in outputs if hasattr(output, "activations")]
        seconds, cpu = time.perf_counter() - began, cpu_seconds() - cpu
    finally:
        shutdown_llm(llm)
    if len(kept) != len(rows):
        raise RuntimeError(f"vllm-lens returned activations for {len(kept)} of {len(rows)} rows")
    shapes = {int(stream.shape[0]) for stream in kept}
    if shapes != {layers}:
        raise RuntimeError(f"vllm-lens returned residual streams of {sorted(shapes)} layers; expected {layers}")
    counts = [sum(int(stream.shape[1]) for stream in kept)] * layers
    _checked("vllm-lens", counts, sum(map(len, rows)), layers)
    return {"tokens": sum(map(len, rows)), "seconds": seconds, "cpu": cpu}


def interp_engine_harvest(checkpoint: str, rows: list[list[int]]) -> dict:
    """interp-engine's hooked vLLM backend capturing ``resid_post`` (``model.layers.i`` output) of every block of
    ``rows``, kept in memory; tokens, wall seconds and CPU seconds of the harvest (not the engine build)."""
    import asyncio

    os.environ[VLLM_LENS_DISABLE] = "1"
    refuse_nnsight("interp-engine")
    import interp_engine
    from interp_engine import Address, load_model

    # The engine core runs in a process of its own: it imports interp-engine's worker extension too.
    where = str(Path(interp_engine.__file__).resolve().parent.parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [where, os.environ.get("PYTHONPATH")]))

    layers = _layers(checkpoint)
    points = [Address("resid_post", layer) for layer in range(layers)]

    async def run() -> tuple[list[dict], float, float]:
        model = load_model(checkpoint, backend="vllm", dtype="float32", extra_vllm_kwargs=engine_settings(checkpoint))
        try:
            await model.warmup()  # builds the engine (lazily built otherwise, on the first capture)
            began, cpu = time.perf_counter(), cpu_seconds()
            kept = await asyncio.gather(*(model.capture(list(row), points) for row in rows))
            return kept, time.perf_counter() - began, cpu_seconds() - cpu
        finally:
            await model.shutdown()

    kept, seconds, cpu = asyncio.run(run())
    _checked(
        "interp-engine",
        [sum(int(row[point].shape[0]) for row in kept) for point in points],
        sum(map(len, rows)),
        layers,
    )
    return {"tokens": sum(map(len, rows)), "seconds": seconds, "cpu": cpu}


def engine_settings(checkpoint: str) -> dict:
    """The vLLM engine arguments interp-engine's engine gets on top of its own: the harvest engine's scheduler
    settings and KV cache (its dtype goes through ``load_model``)."""
    settings = {key: value for key, value in ENGINE_SETTINGS.items() if key != "dtype"}
    return {**settings, **kv_cache_settings(checkpoint)}


def sample_rows(checkpoint: str, documents: int, tokens: int) -> list[list[int]]:
    """``documents`` rows of about ``tokens`` tokens: the shipped corpus's sentences, tokenized, joined and cut."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    sentences = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()]
    ids = [token for sentence in sentences for token in tokenizer(sentence + " ")["input_ids"]]
    rows = []
    for i in range(documents):
        length = tokens - 8 + (i * 5) % 17  # lengths around ``tokens``, not all equal
        start = (i * tokens) % max(1, len(ids) - length)
        rows.append(ids[start : start + length])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", choices=sorted(VERSIONS), default="vllm-lens")
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=60, help="about this many tokens a row")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as benchmarks/harvest.py runs the peers
    from nnterp_vllm.checkpoints import smollm2

    sys.path.insert(0, str(install(Path(__file__).resolve().parent.parent / ".cache")))
    checkpoint = str(smollm2())
    rows = sample_rows(checkpoint, args.documents, args.tokens)
    run = vllm_lens_harvest if args.peer == "vllm-lens" else interp_engine_harvest
    done = run(checkpoint, rows)
    print(json.dumps({"peer": args.peer, **done, "tokens/s": done["tokens"] / done["seconds"]}))


if __name__ == "__main__":
    main()
