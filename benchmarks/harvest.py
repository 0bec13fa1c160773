"""Harvest throughput on SmolLM2-135M (CPU, fp32), each measurement in its own process, in one run.

(a) the ceiling: a plain transformers forward of the base model (sdpa, no KV cache, no head)
    with ``output_hidden_states=True`` over the harvest's own rows, keeping every block's output;
(b) our harvest of all 30 ``layer_output`` s, to disk;
(c) our harvest of ``layers.3.layer_output`` only, against (c0) a plain forward of a 4-block model;
(d) SAELens's own activation caching (``CacheActivationsRunner``) of ``model.layers.3``, same
    model, corpus, context and batch size (its model and a local text dataset, offline);
(e) our harvest on vLLM through nnsight (a `StandardizedVLLM` passed in), all 30 ``layer_output`` s;
(f) our harvest on vLLM as it runs by default, the values kept inside the engine's compiled model, of all 30
    ``layer_output`` s and of ``layers.3.layer_output`` (and (f-last) of all 30 at each row's last position only:
    tokens/s counts the tokens fed through the model), each by an engine built for it as the harvest builds
    one (the second runs 4 blocks), against (g) plain vLLM prefilling the same rows (``max_tokens=1``, its
    default compiled mode, the same scheduler settings), the ceiling;
in the two arrangements of vLLM's engine: in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; the harvest
chooses it for an engine it builds, unless told) and in a process of its own (vLLM's default: (g-own) plain vLLM
as a user gets it, (f-own) our harvest told to run so);
(w) the disk: a plain write of as many bytes as (f) wrote, into the same directory, with fsync, against (f)'s own
    bytes written per second, and against (w2) the harvest's writing alone, where the engine is faster than the disk:
    the same bytes through the in-engine path's own steps (the shard file begun, its values' region filled from
    memory as the engine's worker fills it, checksummed and renamed), then fsync;
with ``--peers``, (p1) vllm-lens and (p2) interp-engine's vLLM backend keeping every block's residual stream of
the same rows in memory (`peers`; installed into ``.cache/`` on first use), each with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` as (f) runs, and (p1-own, p2-own) as it runs by default (``1``, vLLM's default;
interp-engine's ``AsyncLLM`` keeps its engine core in a process of its own either way);
and reading (b)'s harvest back with ``batches``: shuffled against sequential;
with ``--out s3://bucket/prefix`` (the store's usual environment: ``AWS_ENDPOINT_URL``, keys), (s) our harvest on
vLLM as (f) (all 30, and (s3) layers.3 as (f3)), to the store, in the same alternating rounds as (f) to disk and
(g), and reading (f)'s harvest back from disk against (s)'s from the store (through the read-through cache, first
pass cold). (a)-(c), (g)/(f) and the peers run in alternating rounds (``--rounds``), so both sides of a ratio see
the same load; the ratios are the median of the rounds'. Two workloads (``--workloads``): ``packed``, documents
packed into rows of exactly the context length (as SAELens does; every measurement), and ``short``, whole short
documents as they come (the vLLM measurements).

Tokens/s and CPU time exclude model loading (CPU time: every thread of every process of the measurement, an
engine core in its own process included); peak RSS is the measuring process's. The corpus: documents built from
the shipped corpus's sentences. Prints the numbers and ratios; asserts nothing.

    python benchmarks/harvest.py [--documents 240] [--short-documents 32] [--context-length 128] [--rounds 3]
                                 [--workloads packed,short] [--only plain-vllm,vllm,...] [--peers]
                                 [--out s3://bucket/prefix]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from peers import cpu_seconds

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CORPUS = Path(__file__).resolve().parent.parent / "nnterp_vllm" / "data" / "corpus.jsonl"
BATCH_SIZE = 8
SHARD_BYTES = 256 * 2**20
#: How a run's ``--shard-mb`` reaches its measurements.
SHARD_VARIABLE = "NNTERP_BENCH_SHARD_BYTES"
SHALLOW = 3  # the block (c) and (d) read: layers.3.layer_output, SAELens's model.layers.3
READ_BATCH = 1024
#: Measured in alternating rounds: each ratio's two sides see the same load.
PAIRED = (
    "plain",
    "ours",
    "plain-4",
    "ours-3",
    "plain-vllm",
    "vllm",
    "vllm-last",
    "plain-vllm-own",
    "vllm-own",
    "disk",
    "writer",
)
PEERS = ("vllm-lens", "interp-engine", "vllm-lens-own", "interp-engine-own")
#: Measured in the rounds where ``--out`` names a store.
STORE = ("vllm-store",)
#: Measured once, after the rounds.
ONCE = ("saelens", "vllm-nnsight", "read", "read-vllm", "read-store")
#: The measurements of the short-documents workload.
SHORT = ("plain-vllm", "vllm", "vllm-last", "plain-vllm-own", "vllm-own", *PEERS, "disk", "writer")
#: vLLM's engine arrangement per measurement: ``0`` in the measuring process, ``1`` in a process of its own; the
#: default harvest is left to choose (it runs its engine in its process unless told).
ENGINE_PROCESS = {
    "plain-vllm": "0",
    "vllm-own": "1",
    "plain-vllm-own": "1",
    "vllm-nnsight": "0",
    **{peer: "1" if peer.endswith("-own") else "0" for peer in PEERS},
}
MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"


def context_settings(context_length: int | None):
    """How the workload makes rows: documents packed into rows of ``context_length``, or (None) whole documents."""
    from nnterp_vllm.harvest.corpus import ContextSettings

    return ContextSettings(context_length=context_length, overflow="pack" if context_length else "truncate")


def harvest_rows(checkpoint: str, corpus: Path, context_length: int | None) -> list[list[int]]:
    """The harvest's rows of the corpus (`context_settings`)."""
    from transformers import AutoTokenizer

    from nnterp_vllm.harvest.corpus import read_documents, rows

    settings = context_settings(context_length)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    return [list(row.token_ids) for row in rows(read_documents(str(corpus), settings=settings), tokenizer, settings)]


def plain_vllm_prefill(checkpoint: str, corpus: Path, context_length: int | None) -> dict:
    """Plain vLLM (its default compiled mode, the harvest engine's scheduler settings) prefilling the harvest's
    rows, one token sampled each; tokens, seconds, CPU seconds."""
    from vllm import LLM, SamplingParams

    from nnterp_vllm.engines.engine_defaults import engine_kwargs
    from nnterp_vllm.engines.lifecycle import shutdown_llm
    from nnterp_vllm.harvest.in_engine import ENGINE_DEFAULTS

    prompts = [{"prompt_token_ids": ids} for ids in harvest_rows(checkpoint, corpus, context_length)]
    llm = LLM(checkpoint, **engine_kwargs(checkpoint, dtype="float32", **ENGINE_DEFAULTS))
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        began, cpu = time.perf_counter(), cpu_seconds()
        llm.generate(prompts, params, use_tqdm=False)
        return measured(sum(len(prompt["prompt_token_ids"]) for prompt in prompts), began, cpu)
    finally:
        shutdown_llm(llm)


def disk_write(directory: Path, size: int) -> dict:
    """The disk's own sequential write bandwidth: ``size`` bytes written to a new file in ``directory`` in 8 MiB
    blocks, then fsync; bytes, seconds."""
    block = os.urandom(8 * 2**20)
    path = directory / "disk-bandwidth"
    began = time.perf_counter()
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        written = 0
        while written < size:
            written += os.write(descriptor, block[: min(len(block), size - written)])
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
        path.unlink()
    return {"tokens": 0, "bytes": size, "seconds": time.perf_counter() - began, "cpu": 0.0}


def harvest_writing(directory: Path, size: int) -> dict:
    """The in-engine harvest's writing alone, of a shard of ``size`` bytes of values (576-wide float32 rows; one
    region, as the engine's worker opens it): the shard file begun (`store.place_shard`), the region filled from
    memory (its whole chunks straight to the disk where the file system allows), the shard checksummed over the
    chunks' digests and renamed (`store.write_shard`), then fsync; bytes, seconds."""
    import torch

    from nnterp_vllm.engines.steered.shared_rows import SharedRows, open_region
    from nnterp_vllm.harvest.compute import metadata
    from nnterp_vllm.harvest.corpus import Row
    from nnterp_vllm.harvest.store import Placed, place_shard, write_shard

    tokens = max(1, size // (576 * 4))
    rows = [Row(list(range(tokens)), [0] * tokens, list(range(tokens)))]
    filled = torch.randn(1, tokens, 576)
    settings = {"format": "safetensors"}
    began = time.perf_counter()
    columns, _ = metadata(rows, "all")
    placed, start = place_shard(directory, 0, columns, [("values", torch.float32, [tokens, 576])])
    region = SharedRows(1, tokens, 576, torch.float32, file=placed, start=start)
    opened = open_region(region.destination(0), torch.float32)  # as the engine's worker opens it
    opened.put(0, filled)
    opened.close()
    done = Placed(placed, region.chunk_digests())
    region.close()
    record = write_shard(directory, 0, {**columns, "values": [region.tensor[0]]}, {}, settings, done)
    descriptor = os.open(directory / record["file"], os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    seconds = time.perf_counter() - began
    (directory / record["file"]).unlink()
    return {"tokens": 0, "bytes": record["bytes"], "seconds": seconds, "cpu": 0.0}


def build_corpus(path: Path, count: int) -> None:
    """``count`` documents of 2-6 sentences drawn, deterministically, from the shipped corpus."""
    sentences = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()]
    with open(path, "w") as handle:
        for i in range(count):
            picks = [sentences[(i * 7 + j * 13) % len(sentences)] for j in range(2 + i % 5)]
            handle.write(json.dumps({"text": " ".join(picks)}) + "\n")


def measured(tokens: int, began: float, cpu: float, **more: object) -> dict:
    """A run's record: tokens, wall seconds and CPU seconds since ``began`` / ``cpu``, and ``more``."""
    return {"tokens": tokens, "seconds": time.perf_counter() - began, "cpu": cpu_seconds() - cpu, **more}


def plain_forward(checkpoint: str, corpus: Path, context_length: int, blocks: int | None) -> dict:
    """Tokens through the base model (``blocks`` of them, or all) over the harvest's rows, keeping every
    block's output for the real tokens; seconds."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nnterp_vllm.harvest.compute import batches
    from nnterp_vllm.harvest.corpus import read_documents, rows
    from nnterp_vllm.harvest.run import plan

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    extra = {} if blocks is None else {"num_hidden_layers": blocks}
    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa", **extra).eval()
    base = model.model
    began, cpu = time.perf_counter(), cpu_seconds()
    settings = context_settings(context_length)
    per_token = model.config.num_hidden_layers * model.config.hidden_size * 4
    units = plan(rows(read_documents(str(corpus), settings=settings), tokenizer, settings), SHARD_BYTES // per_token)
    tokens = 0
    for unit in units:
        for _, ids, mask in batches(unit.rows, BATCH_SIZE, tokenizer.pad_token_id or 0):
            with torch.no_grad():
                hidden = base(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
            kept = [layer[mask.bool()].clone() for layer in hidden.hidden_states[1:]]  # what a harvest keeps
            tokens += int(mask.sum())
            del kept
    return measured(tokens, began, cpu)


def our_harvest(
    checkpoint: str,
    corpus: Path,
    context_length: int,
    engine: str,
    selections: list[list[str]],
    out: Path,
    through_nnsight: bool = False,
    positions: str = "all",
):
    """Per selection: tokens harvested to disk (a directory under ``out``) by a model built for it as the
    harvest builds one (`build_settings`: attention on transformers, the blocks run and the in-engine path on
    vLLM; a `StandardizedVLLM` where ``through_nnsight``), at ``positions`` (the tokens counted are those that went
    through the model, whatever is kept of them); seconds and CPU seconds, model loading excluded; the attention
    used; the blocks each forward ran; the vLLM path."""
    from nnterp_vllm.harvest import harvest
    from nnterp_vllm.harvest.compute import build_settings, load_model
    from nnterp_vllm.harvest.in_engine import CAPTURE_ONLY, CAPTURE_VALUES, ENGINE_DEFAULTS, EngineHarvester
    from nnterp_vllm.specs.selection import check_selectors

    results = []
    for number, values in enumerate(selections):
        given = {"dtype": "float32"} if engine == "vllm" else {}
        settings = build_settings(check_selectors(values, context_length), engine, given)
        if through_nnsight:
            settings = {name: value for name, value in settings.items() if name not in ENGINE_DEFAULTS | CAPTURE_ONLY}
            settings.pop(CAPTURE_VALUES, None)
        target = out
        if number:
            target = f"{out}-{number}" if isinstance(out, str) else out.with_name(f"{out.name}-{number}")
        model = load_model(checkpoint, engine, settings)
        try:
            began, cpu = time.perf_counter(), cpu_seconds()
            result = harvest(
                model.llm if isinstance(model, EngineHarvester) else model,  # a SteeredVLLM, as a user passes one
                str(corpus),
                values,
                target,
                context_length=context_length,
                overflow="pack" if context_length else None,
                batch_size=BATCH_SIZE,
                shard_bytes=int(os.environ.get(SHARD_VARIABLE, SHARD_BYTES)),
                positions=positions,
                progress=False,
            )
            fed = len(result) if positions == "all" else sum(map(len, harvest_rows(checkpoint, corpus, context_length)))
            run = measured(fed, began, cpu)
        finally:
            if engine == "vllm":
                model.shutdown()
        manifest = result.manifest
        written = sum(record["bytes"] for record in manifest["shards"].values())
        note = f"attention {manifest['attention']}, {manifest['blocks_run']} blocks"
        if manifest.get("vllm_path"):
            note += f", path {manifest['vllm_path']}"
        if manifest.get("engine_process"):
            note += f", engine {manifest['engine_process']}"
        results.append({**run, "bytes": written, "note": note})
    return results


def saelens_caching(checkpoint: str, corpus: Path, context_length: int, tokens: int, out: Path) -> dict:
    """SAELens's CacheActivationsRunner over the same text, model, block and context; tokens cached, seconds."""
    from sae_lens import CacheActivationsRunner, CacheActivationsRunnerConfig

    text = out.with_name("saelens-text")
    text.mkdir()
    shutil.copy(corpus, text / "train.jsonl")
    batch = BATCH_SIZE * context_length
    per_buffer = max(batch, tokens // 2 // batch * batch)  # two buffers, whole batches each
    tokens = 2 * per_buffer
    config = CacheActivationsRunnerConfig(
        dataset_path=str(text),
        model_name=checkpoint,
        model_class_name="AutoModelForCausalLM",
        model_batch_size=BATCH_SIZE,
        hook_name=f"model.layers.{SHALLOW}",
        d_in=576,
        training_tokens=tokens,
        context_size=context_length,
        new_cached_activations_path=str(out),
        shuffle=False,
        dtype="float32",
        device="cpu",
        buffer_size_gb=(per_buffer + 0.5) * 576 * 4 / 1e9,
        streaming=False,
        prepend_bos=True,
    )
    runner = CacheActivationsRunner(config)
    began, cpu = time.perf_counter(), cpu_seconds()
    dataset = runner.run()
    return measured(len(dataset) * context_length, began, cpu)


def read_back(out: Path | str, rounds: int = 9, cache_dir: Path | None = None) -> dict[str, float]:
    """Tokens/s of one epoch of `Harvest.batches` over every value of a harvest, sequential and shuffled,
    in ``rounds`` rounds of one pass each after a pass that brings the files into the page cache (a store's into
    the read-through cache in ``cache_dir``: that first pass is ``cold``): the best pass of each, and the median of
    the rounds' shuffled/sequential ratios (each round's two passes run back to back, so they see the same load)."""
    from nnterp_vllm import load_harvest

    harvest = load_harvest(out, cache_dir=cache_dir) if isinstance(out, str) else load_harvest(out)

    def rate(shuffle: bool) -> float:
        began = time.perf_counter()
        tokens = sum(len(next(iter(batch.values()))) for batch in harvest.batches(READ_BATCH, shuffle=shuffle))
        return tokens / (time.perf_counter() - began)

    cold = rate(False)
    passes = [(rate(False), rate(True)) for _ in range(rounds)]
    return {
        "cold": cold,
        "sequential": max(sequential for sequential, _ in passes),
        "shuffled": max(shuffled for _, shuffled in passes),
        "median ratio": statistics.median(shuffled / sequential for sequential, shuffled in passes),
    }


def child(name: str, checkpoint: str, corpus: Path, context_length: int | None, scratch: Path, known: dict) -> dict:
    everything, shallow = ["layers.*.layer_output"], [f"layers.{SHALLOW}.layer_output"]
    if name == "plain":
        done = {"runs": [plain_forward(checkpoint, corpus, context_length, None)]}
    elif name == "plain-4":
        done = {"runs": [plain_forward(checkpoint, corpus, context_length, SHALLOW + 1)]}
    elif name in ("ours", "ours-3"):
        selection, out = ([everything], scratch / "all") if name == "ours" else ([shallow], scratch / "three")
        shutil.rmtree(out, ignore_errors=True)  # a new harvest each round, not a resumed one
        done = {"runs": our_harvest(checkpoint, corpus, context_length, "transformers", selection, out)}
    elif name == "saelens":
        done = {"runs": [saelens_caching(checkpoint, corpus, context_length, known["tokens"], scratch / "saelens")]}
    elif name in ("vllm", "vllm-own"):
        out = scratch / name
        for directory in (out, out.with_name(f"{out.name}-1")):
            shutil.rmtree(directory, ignore_errors=True)
        done = {"runs": our_harvest(checkpoint, corpus, context_length, "vllm", [everything, shallow], out)}
    elif name == "vllm-last":
        out = scratch / name
        shutil.rmtree(out, ignore_errors=True)
        done = {"runs": our_harvest(checkpoint, corpus, context_length, "vllm", [everything], out, positions="last")}
    elif name == "vllm-store":
        out = f"{known['out'].rstrip('/')}/{os.getpid()}-{time.time_ns()}"  # a new harvest each round
        done = {"runs": our_harvest(checkpoint, corpus, context_length, "vllm", [everything, shallow], out)}
        (scratch / "store-url").write_text(out)
    elif name in ("plain-vllm", "plain-vllm-own"):
        done = {"runs": [plain_vllm_prefill(checkpoint, corpus, context_length)]}
    elif name == "vllm-nnsight":
        out = scratch / "vllm-nnsight"
        done = {
            "runs": our_harvest(checkpoint, corpus, context_length, "vllm", [everything], out, through_nnsight=True)
        }
    elif name in PEERS:
        import peers

        sys.path.insert(0, str(peers.install(Path(__file__).resolve().parent.parent / ".cache")))
        run = peers.vllm_lens_harvest if name.startswith("vllm-lens") else peers.interp_engine_harvest
        done = {"runs": [run(checkpoint, harvest_rows(checkpoint, corpus, context_length))]}
    elif name == "disk":
        done = {"runs": [disk_write(scratch, known.get("bytes") or 256 * 2**20)]}
    elif name == "writer":
        done = {"runs": [harvest_writing(scratch, known.get("bytes") or 256 * 2**20)]}
    elif name == "read-vllm":
        done = {"read": read_back(scratch / "vllm", rounds=3)}
    elif name == "read-store":
        done = {"read": read_back((scratch / "store-url").read_text(), rounds=3, cache_dir=scratch / "read-cache")}
    else:
        done = {"read": read_back(scratch / "all")}
    done["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=240, help="documents of the packed workload")
    parser.add_argument("--short-documents", type=int, default=32, help="documents of the short workload")
    parser.add_argument("--context-length", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of the paired measurements")
    parser.add_argument("--workloads", default="packed,short", type=lambda text: text.split(","))
    parser.add_argument(
        "--peers", action="store_true", help="also measure vllm-lens and interp-engine (installed once)"
    )
    parser.add_argument(
        "--only",
        help="measure only these, comma-separated: " + ", ".join([*PAIRED, *PEERS, *ONCE]),
        type=lambda text: text.split(","),
    )
    parser.add_argument(
        "--out", help="also harvest on vLLM to this store URL (s3://bucket/prefix) and read it back, against disk"
    )
    parser.add_argument(
        "--shard-mb",
        type=float,
        help="shard size of our harvests (default 256): a run of few shards ends with one shard's upload to a store",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    parser.add_argument("--known", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.shard_mb:
        os.environ[SHARD_VARIABLE] = str(int(args.shard_mb * 2**20))
    from nnterp_vllm.checkpoints import smollm2

    checkpoint = str(smollm2())
    if args.child:
        scratch = Path(args.scratch)
        context_length = args.context_length or None
        result = child(
            args.child, checkpoint, scratch / "corpus.jsonl", context_length, scratch, json.loads(args.known)
        )
        print(json.dumps(result))
        return
    for workload in args.workloads:
        packed = workload == "packed"
        names = [*PAIRED, *(PEERS if args.peers else ()), *(STORE if args.out else ())] * args.rounds + list(ONCE)
        if not args.out:
            names = [name for name in names if name not in ("read-vllm", "read-store")]
        names = [name for name in names if (packed or name in SHORT) and (not args.only or name in args.only)]
        results: dict[str, list[dict]] = {}
        with tempfile.TemporaryDirectory(prefix="harvest-bench-") as scratch:
            build_corpus(Path(scratch) / "corpus.jsonl", args.documents if packed else args.short_documents)
            known: dict = {"out": args.out} if args.out else {}
            for name in names:
                command = [
                    sys.executable,
                    __file__,
                    "--child",
                    name,
                    "--scratch",
                    scratch,
                    f"--known={json.dumps(known)}",
                ]
                command += [f"--context-length={args.context_length if packed else 0}"]
                env = {key: value for key, value in os.environ.items() if key != MULTIPROCESSING}
                if name in ENGINE_PROCESS:
                    env[MULTIPROCESSING] = ENGINE_PROCESS[name]
                done = subprocess.run(command, capture_output=True, text=True, env=env)
                if done.returncode != 0:
                    print(f"  {workload} {name}: failed\n{done.stderr[-3000:]}")
                    continue
                results.setdefault(name, []).append(json.loads(done.stdout.strip().splitlines()[-1]))
                if "runs" in results[name][0]:  # a measurement of reading has none
                    first = results[name][0]["runs"][0]
                    known.setdefault("tokens", first["tokens"])
                    if name == "vllm":
                        known.setdefault("bytes", first["bytes"])
        report(results, args, workload)


def report(results: dict[str, list[dict]], args: argparse.Namespace, workload: str) -> None:
    """Per measurement its median over the rounds; per ratio the median of the rounds' ratios, with their range."""
    rates: dict[str, list[float]] = {}
    seconds: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    written: dict[str, list[float]] = {}
    labels = {
        "plain": "(a) plain forward, base model, all hidden states",
        "ours": "(b) our harvest, all 30 layer_outputs",
        "plain-4": "(c0) plain forward of 4 blocks",
        "ours-3": f"(c) our harvest, layers.{SHALLOW}.layer_output",
        "saelens": f"(d) SAELens CacheActivationsRunner, model.layers.{SHALLOW}",
        "vllm-nnsight": "(e) our harvest on vLLM through nnsight, all 30",
        "plain-vllm": "(g) plain vLLM prefill, in-process",
        "vllm": "(f) our harvest on vLLM in the engine, all 30",
        "vllm-3": f"(f3) our harvest on vLLM in the engine, layers.{SHALLOW}",
        "plain-vllm-own": "(g-own) plain vLLM prefill, engine in own process",
        "vllm-own": "(f-own) our harvest, all 30, engine in own process",
        "vllm-own-3": f"(f3-own) our harvest, layers.{SHALLOW}, own process",
        "vllm-lens": "(p1) vllm-lens, all 30 residuals, in memory",
        "interp-engine": "(p2) interp-engine vLLM backend, all 30, in memory",
        "vllm-lens-own": "(p1-own) vllm-lens, as it runs by default",
        "interp-engine-own": "(p2-own) interp-engine, as it runs by default",
        "disk": "(w) the disk: plain write + fsync, same bytes as (f)",
        "writer": "(w2) the harvest's writing alone, + fsync, same bytes",
        "vllm-store": "(s) our harvest on vLLM in the engine, all 30, to the store",
        "vllm-store-3": f"(s3) our harvest on vLLM in the engine, layers.{SHALLOW}, to the store",
        "vllm-last": "(f-last) our harvest on vLLM in the engine, all 30, each row's last position",
    }
    rows = f"{args.documents} documents packed into rows of {args.context_length}"
    if workload == "short":
        rows = f"{args.short_documents} short documents, whole"
    print(
        f"SmolLM2-135M fp32, {rows}, batch {BATCH_SIZE}; paired measurements in {args.rounds} alternating rounds, "
        "medians"
    )
    for name, rounds in results.items():
        for index in range(len(rounds[0].get("runs", []))):
            key = name if index == 0 else f"{name}-3"
            runs = [result["runs"][index] for result in rounds]
            seconds[key] = [run["seconds"] for run in runs]
            written[key] = [run.get("bytes", 0) / run["seconds"] / 2**20 for run in runs]
            peak = max(result["peak_mib"] for result in rounds)
            if name in ("disk", "writer"):
                print(f"  {labels[key]:54s} {statistics.median(written[key]):8.1f} MiB/s  ({runs[0]['bytes']} bytes)")
                continue
            rates[key] = [run["tokens"] / run["seconds"] for run in runs]
            cpu[key] = [run["cpu"] / run["tokens"] * 1000 for run in runs]
            wrote = f"  wrote {statistics.median(written[key]):6.1f} MiB/s" if runs[0].get("bytes") else ""
            print(
                f"  {labels[key]:54s} {statistics.median(rates[key]):8.1f} tokens/s  "
                f"{statistics.median(seconds[key]):6.1f} s  CPU {statistics.median(cpu[key]):5.2f} s/1k tokens  "
                f"peak RSS {peak:6.0f} MiB  ({runs[0]['tokens']} tokens){wrote}  {runs[0].get('note', '')}"
            )
    for key, what in (("read", "(b) back"), ("read-vllm", "(f) back from disk"), ("read-store", "(s) from the store")):
        if key in results:
            read, peak = results[key][0]["read"], results[key][0]["peak_mib"]
            print(
                f"  reading {what}, batches of {READ_BATCH}, every value, the default 256 MiB window, best pass "
                f"(peak RSS {peak:.0f} MiB):"
            )
            for name in ("cold", "sequential", "shuffled"):
                print(f"    {name:18s} {read[name]:10.0f} tokens/s")
    print("ratios (goal):")

    def ratio(text: str, top: str, bottom: str, goal: str, by: dict = rates) -> None:
        if top in by and bottom in by:
            each = [a / b for a, b in zip(by[top], by[bottom])]
            spread = f"  rounds {min(each):.3f}..{max(each):.3f}" if len(each) > 1 else ""
            print(f"  {text:50s} {statistics.median(each):6.3f}   ({goal}){spread}")

    ratio("(b)/(a) tokens/s", "ours", "plain", ">= 0.95")
    ratio("(c) time / (c0) time", "ours-3", "plain-4", "<= 1.2", by=seconds)
    ratio("(c)/(d) tokens/s", "ours-3", "saelens", ">= 1")
    ratio("(c)/(b) tokens/s: cost falls with depth", "ours-3", "ours", "> 1")
    ratio("(f)/(g) tokens/s (wall), both in-process", "vllm", "plain-vllm", ">= 0.95")
    ratio("(g)/(f) CPU time per token, both in-process", "plain-vllm", "vllm", ">= 0.95", by=cpu)
    ratio("(f)/(g-own) tokens/s: as each runs by default", "vllm", "plain-vllm-own", ">= 0.95")
    ratio("(g-own)/(f) CPU per token: as each runs by default", "plain-vllm-own", "vllm", ">= 0.95", by=cpu)
    ratio("(f-own)/(g-own) tokens/s, both in own process", "vllm-own", "plain-vllm-own", ">= 0.95")
    ratio("(g-own)/(f-own) CPU per token, both in own process", "plain-vllm-own", "vllm-own", ">= 0.95", by=cpu)
    ratio("(f3)/(g) tokens/s: 4 blocks against the whole model", "vllm-3", "plain-vllm", ">= 4")
    ratio("(f)/(b) tokens/s: vLLM against transformers", "vllm", "ours", ">= 3")
    ratio("(f)/(e) tokens/s: in the engine against nnsight", "vllm", "vllm-nnsight", "")
    for peer in PEERS:
        ratio(f"(f)/({peer}) tokens/s", "vllm", peer, ">= 1.2")
        ratio(f"({peer})/(f) CPU per token", peer, "vllm", "", by=cpu)
    ratio("(w2)/(w) bytes/s: the harvest's writing / the disk", "writer", "disk", ">= 0.9", by=written)
    ratio("(f-last)/(f) tokens/s: each row's last position / every position", "vllm-last", "vllm", ">= 1")
    ratio("(s)/(f) tokens/s: to the store / to disk", "vllm-store", "vllm", ">= 0.9")
    ratio("(s)/(g) tokens/s: to the store / plain vLLM prefill", "vllm-store", "plain-vllm", "")
    ratio("(s3)/(f3) tokens/s: one value, to the store / to disk", "vllm-store-3", "vllm-3", ">= 0.9")
    if "read-store" in results and "read-vllm" in results:
        store, disk = results["read-store"][0]["read"], results["read-vllm"][0]["read"]
        for name in ("cold", "sequential", "shuffled"):
            print(f"  {f'reading from the store / from disk, {name}':50s} {store[name] / disk[name]:6.3f}")
    if "disk" in written:
        for key in ("vllm", "vllm-3"):
            if key in written:
                share = statistics.median(written[key]) / statistics.median(written["disk"])
                print(
                    f"  {f'({key}) bytes written/s / the disk (w)':50s} {share:6.3f}   (the engine is the limit here)"
                )
    if "read" in results:
        read = results["read"][0]["read"]
        print(
            f"  {'shuffled / sequential read, best passes':50s} {read['shuffled'] / read['sequential']:6.3f}   (>= 0.8)"
        )
        print(f"  {'shuffled / sequential read, median round':50s} {read['median ratio']:6.3f}   (>= 0.8)")


if __name__ == "__main__":
    main()
