"""``nnterp-vllm serve`` over loopback: real clients (``openai``, ``httpx``) against the real server.

One server process (the ``nnterp-vllm`` console script, tiny llama) serves every test of the module, over TLS
with a certificate the module makes (its clients trust it through ``SSL_CERT_FILE``), its engine started on a
stand-in 80 GB accelerator as vLLM's GPU worker checks its memory (``tests/fake_device``); what each steered
request must answer comes first, from `SteeredVLLM.generate` in this process, shut down before the server
starts. The last tests stop that server with SIGTERM (it drains, exits 0 and leaves no process or
shared-memory file behind) and then run the 2-replica Ray Serve deployment.
"""

from __future__ import annotations

import asyncio
import functools
import io
import json
import math
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import psutil
import pytest
import reference
import tiny
import torch
from safetensors.torch import save_file
from vllm import SamplingParams

from nnterp_vllm import (
    SAE,
    Ablate,
    Cap,
    Capture,
    Clamp,
    LogitDiff,
    Patch,
    Probe,
    Recovered,
    StandardizedTransformer,
    StandardizedVLLM,
    SteeredVLLM,
    Steering,
    load_steering,
    patch_sweep,
)
from nnterp_vllm.serve.intake import RequestField, RequestIntake, record
from nnterp_vllm.serve.server import PROBES, STEERING_ROUTES, with_probes

SERVE = str(Path(sys.executable).with_name("nnterp-vllm"))
MODEL = "tiny"
STEPS = 12
#: Engine arguments of the server and of the in-process engine that computes what it must answer. The step sizes are
#: vLLM's own for an in-process engine on CPU, given to the server too (whose defaults are smaller): an engine and a
#: server built alike compile one graph between them (the second finds it in the compile cache).
ENGINE = {
    "dtype": "float32",
    "max_model_len": 256,
    "kv_cache_memory_bytes": 32 * 2**20,
    "max_num_batched_tokens": 4096,
    "max_num_seqs": 256,
}
#: The server's steering pool: room for this many distinct block contents at once.
POOL_ENTRIES = 8
GREEDY = {"max_tokens": STEPS, "temperature": 0.0}
EXTRA = {"ignore_eos": True, "return_token_ids": True}
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
MESSAGES = [{"role": "user", "content": "Name a colour."}]
PROMPT = "The quick brown fox"
CONCURRENT = 64
STARTUP_SECONDS = 300
#: The server runs with --api-key: every route but /health and /ping needs it.
KEY = "test-key"
#: A second client's key: its edits and traces are its own.
OTHER_KEY = "other-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
#: Vectors the served registry holds at most (--max-steering-vectors), small enough to fill.
CAPACITY = 5
#: What the server keeps for requests' capture field (--capture-values), and the most bytes one may ask for.
KEPT = ["layers.*.layer_output", "layers.0.mlp_output"]
MAX_CAPTURE_BYTES = 100_000
CAPTURED = Capture(["layers.1.layer_output", "layers.0.mlp_output"])
#: The bounds of the traces the server runs (--traces).
TRACE_BOUNDS = {"--max-trace-bytes": 2_000_000, "--trace-timeout": 4, "--max-saved-bytes": 8_000_000}
#: The directory whose ``sitecustomize`` starts the server's engine on a stand-in accelerator.
FAKE_DEVICE = Path(__file__).parent / "fake_device"
#: A prompt as long as PROMPT (one token a character): a transformers batch of the two needs no padding.
SAME_LENGTH = "Hello, how are you?"
#: Prompts of the concurrent traces, one per client.
TRACE_PROMPTS = ["Hello world", "The cat", "A dog ran far", "Blue sky", "One two three", "Red", "Green tea", "Paris is"]
#: Captures of the SAEs' features the server holds (--sae): a TopK SAE's top 4, a standard SAE's chosen features.
#: Steered models the server starts with (--steered-model): a recipe's short form, and a YAML file of specs.
FORMAL_RECIPE = "preloaded@1:3.0+preloaded@2:-2.0"
CAPPED_RECIPE = """\
- {kind: cap, vector: preloaded, layers: 1, max: -0.5, positions: generated}
- {vector: control, factor: 2.0}
"""
#: The same recipes as a request's steering field.
RECIPES = {
    "formal": [
        {"vector": "preloaded", "layers": 1, "factor": 3.0},
        {"vector": "preloaded", "layers": 2, "factor": -2.0},
    ],
    "capped": [
        {"kind": "cap", "vector": "preloaded", "layers": 1, "max": -0.5, "positions": "generated"},
        {"vector": "control", "factor": 2.0},
    ],
}
#: A probe read over HTTP, and gating a spec.
SERVED_PROBE = Probe(torch.linspace(-1, 1, tiny.SIZES["hidden_size"]), bias=0.1, layer=1)
#: A patching sweep over HTTP: the prompts, blocks and positions, and the tokens its logit difference reads.
SWEEP = {
    "clean": "Anna met Bert; Bert gave a gift to",
    "corrupt": "Anna met Bert; Anna gave a gift to",
    "layers": [0, 2],
}
SWEEP["positions"] = [1, -3, -1]
SWEPT_TOKENS = (33, 300)
SAE_CAPTURES = [
    Capture("layers.2.sae_features", top_k=4),
    Capture(["layers.1.sae_features", "layers.0.mlp_output"], positions="last", features=[2, 7]),
]


def control_vector_file(path: Path, directions: dict[int, torch.Tensor]) -> Path:
    """A control vector as repeng's ``export_gguf`` writes it (architecture ``controlvector``)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "controlvector")
    writer.add_string("controlvector.model_hint", "llama")
    writer.add_uint32("controlvector.layer_count", len(directions))
    for layer, direction in directions.items():
        writer.add_tensor(f"direction.{layer}", direction.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def vectors(hidden_size: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(17)
    return {name: torch.randn(hidden_size, generator=generator) * 4 for name in ("inline", "preloaded", "posted")}


def as_json(specs: list, names: dict[int, str] | None = None) -> list[dict]:
    """Specs as a request's ``steering`` field; ``names`` sends spec ``i``'s vector by its registered name."""
    names = names or {}
    fields = []
    for i, spec in enumerate(specs):
        if isinstance(spec, Clamp):
            target = {"value": spec.value} if spec.value is not None else {"scale": spec.scale}
            fields.append(
                {"kind": "clamp", "sae": spec.sae.name, "feature": spec.feature, **target, "positions": spec.positions}
            )
            continue
        if isinstance(spec, Patch):
            fields.append(
                {
                    "kind": "patch",
                    "layers": spec.layers,
                    "vectors": spec.rows().tolist(),
                    "positions": spec.positions,
                    "value": spec.value,
                }
            )
            continue
        field = {"layers": spec.layers, "vector": names.get(i) or spec.vector.tolist(), "positions": spec.positions}
        if isinstance(spec, Steering):
            field["factor"] = spec.factor
        elif isinstance(spec, Ablate):
            field["kind"] = "ablate"
        else:
            field.update(
                kind="cap",
                **{bound: getattr(spec, bound) for bound in ("min", "max") if getattr(spec, bound) is not None},
            )
        fields.append(field)
    return fields


def concurrent_cases(found: dict[str, torch.Tensor]) -> list[tuple[str, list[Steering], dict[int, str]]]:
    """64 requests: a third steered by an inline vector (own factor each), a third by the preloaded one, a third not."""
    cases = []
    for i in range(CONCURRENT):
        prompt = f"Request {i} is about"
        if i % 3 == 0:
            cases.append((prompt, [Steering(i // 3 % 3, found["inline"], factor=0.5 + i / 16)], {}))
        elif i % 3 == 1:
            cases.append((prompt, [Steering([0, 2], found["preloaded"], positions="generated")], {0: "preloaded"}))
        else:
            cases.append((prompt, [], {}))
    return cases


def trace_experiment(model, **send) -> tuple[torch.Tensor, ...]:
    """Written once, as for a model of one's own: every block's last-token output, a write, three generated steps,
    two invokes. ``send`` (``serve=``, ``api_key=``) sends each trace to a server."""
    outputs = []
    with model.trace(PROMPT, **send):
        for block in model.layers:
            outputs.append(block.layer_output[:, -1].save())
        model.layers[model.num_layers - 1].layer_output[:, -1] *= 0.5
        probs = model.next_token_probs.save()
    with model.generate(PROMPT, max_new_tokens=3, **send) as tracer:
        steps = list().save()
        for _ in tracer.iter[:3]:
            steps.append(model.layers[2].layer_output[0, -1])
    with model.trace(**send) as tracer:
        with tracer.invoke(PROMPT):
            first = model.layers[0].layer_output.save()
        with tracer.invoke(SAME_LENGTH):
            second = model.layers[0].layer_output.save()
    return torch.cat(outputs), probs, torch.stack(steps), first, second


def client_trace(model, index: int, **send) -> tuple[torch.Tensor, ...]:
    """Client ``index``'s own trace: its prompt, a write of its own at a block of its own, what follows."""
    layer = index % 3
    with model.trace(TRACE_PROMPTS[index], **send):
        ids = model.input_ids.save()
        model.layers[layer].layer_output[:, -1] *= index + 1
        after = model.layers[2].layer_output.save()
        probs = model.next_token_probs.save()
    return ids, after, probs


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def session_processes(session: int) -> list[psutil.Process]:
    """Live processes of a session (the server runs in its own: its engine and workers are in it too)."""
    found = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == session and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return found


def shared_memory_files(processes: list[psutil.Process]) -> set[str]:
    """The /dev/shm files these processes hold open or mapped."""
    found = set()
    for process in processes:
        try:
            found.update(f.path for f in process.open_files() if f.path.startswith("/dev/shm/"))
            found.update(m.path for m in process.memory_maps() if m.path.startswith("/dev/shm/"))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def tls_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key, as PEM files in ``directory``."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


class Server:
    """``nnterp-vllm serve`` in its own session, on a free loopback port (HTTPS where ``scheme`` says)."""

    def __init__(
        self, arguments: list[str], log: Path, env: dict[str, str] | None = None, scheme: str = "http"
    ) -> None:
        self.port = free_port()
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.log = log
        command = [SERVE, "serve", *arguments, "--host", "127.0.0.1", "--port", str(self.port)]
        with open(log, "w") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})}
            )
        self.shared_memory: set[str] = set()
        self.terminated = False

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()[-5000:]
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.note_shared_memory()
                    return
            except httpx.TransportError:
                pass
            time.sleep(1)
        raise TimeoutError(f"the server did not start in {STARTUP_SECONDS} s: {self.log.read_text()[-5000:]}")

    def note_shared_memory(self) -> None:
        self.shared_memory |= shared_memory_files(session_processes(self.process.pid))

    def terminate(self) -> None:
        """SIGTERM, once (what the server holds in /dev/shm noted first)."""
        if not self.terminated and self.process.poll() is None:
            self.note_shared_memory()
            self.process.send_signal(signal.SIGTERM)
            self.terminated = True

    def stop(self, timeout: float = 120) -> int:
        """`terminate`, then wait; kills the session if it does not exit in time. The exit status."""
        self.terminate()
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            raise

    def assert_left_nothing(self) -> None:
        deadline = time.monotonic() + 30
        while session_processes(self.process.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = session_processes(self.process.pid)
        for process in left:
            process.kill()
        assert not left, [p.cmdline() for p in left]
        assert not {path for path in self.shared_memory if os.path.exists(path)}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """What every case must answer (SteeredVLLM, shut down), then the server, with a preloaded vector file, over
    TLS, on a stand-in accelerator (its ledger of what each engine took), with vLLM's development routes (its
    ``/collective_rpc`` asks the engine what ran)."""
    path = tiny.checkpoint("llama")
    tokenizer = tiny.tokenizer()
    directory = tmp_path_factory.mktemp("serve")
    hooks = {
        "res1": ("standard", "blocks.1.hook_resid_post", {}),
        "top2": ("topk", "blocks.2.hook_resid_post", {"k": 8}),
    }
    for name, (kind, hook, cfg) in hooks.items():
        reference.saelens_sae(directory / name, kind, hook, tiny.SIZES["hidden_size"], seed=5, **cfg)
    saes = {name: SAE.load(directory / name, name) for name in hooks}
    local = StandardizedVLLM(path, **ENGINE)
    try:
        traced = trace_experiment(local)
    finally:
        local.shutdown()
    llm = SteeredVLLM(path, capture_values=KEPT, saes=list(saes.values()), max_steering_entries=POOL_ENTRIES, **ENGINE)
    hidden_size = llm.hidden_size
    found = vectors(hidden_size)
    per_layer = {layer: found["inline"] * (layer + 1) / 3 for layer in (0, 2)}
    control = control_vector_file(directory / "control.gguf", per_layer)
    steered = [Steering(1, found["inline"], factor=2.0), Steering(2, found["inline"], factor=-1.0, positions="prompt")]
    chat_ids = tokenizer(
        tokenizer.apply_chat_template(
            MESSAGES, chat_template=CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False
        ),
        add_special_tokens=False,
    )["input_ids"]
    single = {
        "plain": (PROMPT, []),
        "steered": (PROMPT, steered),
        "chat": ({"prompt_token_ids": chat_ids}, []),
        "chat steered": ({"prompt_token_ids": chat_ids}, steered),
        "posted": (PROMPT, [Steering(0, found["posted"], factor=1.5)]),
        "control": (PROMPT, load_steering(control, factor=2.0)),
        "per layer": (
            PROMPT,
            [Steering(layer, vector, factor=-1.0, positions="generated") for layer, vector in per_layer.items()],
        ),
        "directions": (
            PROMPT,
            [
                Steering(1, found["inline"], factor=2.0),
                Ablate(found["preloaded"]),
                Cap(found["posted"], layers=1, max=-0.5, positions="generated"),
            ],
        ),
        "clamps": (
            PROMPT,
            [
                Clamp(saes["res1"], 4, value=5.0),
                Clamp(saes["top2"], 6, scale=3.0, positions="generated"),
                Steering(0, found["inline"]),
            ],
        ),
        "gated": (PROMPT, [Steering(1, found["inline"], factor=3.0, when=(SERVED_PROBE, ">", 0.0))]),
        "formal": (PROMPT, [Steering(1, found["preloaded"], factor=3.0), Steering(2, found["preloaded"], factor=-2.0)]),
        "patches": (
            PROMPT,
            [
                Patch(torch.stack([found["inline"], -found["posted"]]), layers=1, positions=[2, -1]),
                Patch(found["preloaded"] * 0.2, layers=[0, 2], positions=[3], value="attention_output"),
            ],
        ),
    }
    concurrent = concurrent_cases(found)
    try:
        prompts = [prompt for prompt, _ in single.values()] + [prompt for prompt, _, _ in concurrent]
        steering = [specs for _, specs in single.values()] + [specs for _, specs, _ in concurrent]
        outputs = llm.generate(prompts, SamplingParams(**GREEDY, ignore_eos=True), steering)
        kept = llm.generate(
            [PROMPT, {"prompt_token_ids": chat_ids}, PROMPT, PROMPT],
            SamplingParams(**GREEDY, ignore_eos=True),
            [[], steered, [], []],
            capture=[CAPTURED, CAPTURED, *SAE_CAPTURES],
        )
        swept = patch_sweep(llm, **SWEEP, metric=Recovered(LogitDiff(*SWEPT_TOKENS)))
        (probed,) = llm.generate(PROMPT, SamplingParams(**GREEDY, ignore_eos=True), probes={"p": SERVED_PROBE})
    finally:
        llm.shutdown()
    tokens = [list(output.outputs[0].token_ids) for output in outputs]
    vector_file = directory / "vectors.safetensors"
    save_file({"preloaded": found["preloaded"]}, str(vector_file))
    (directory / "chat.jinja").write_text(CHAT_TEMPLATE)
    arguments = [str(path), "--served-model-name", MODEL, "--steering-vectors", str(vector_file), f"control={control}"]
    arguments += ["--capture-values", *KEPT, "--max-capture-bytes", str(MAX_CAPTURE_BYTES)]
    arguments += ["--chat-template", str(directory / "chat.jinja")]
    (directory / "capped.yaml").write_text(CAPPED_RECIPE)
    arguments += ["--steered-model", f"formal={FORMAL_RECIPE}", f"capped={directory / 'capped.yaml'}"]
    arguments += ["--sae", *(f"{name}={directory / name}" for name in saes)]
    arguments += ["--api-key", KEY, OTHER_KEY, "--max-steering-vectors", str(CAPACITY)]
    # A steering pool smaller than the concurrent requests' distinct vectors: they wait for room, none fails.
    arguments += ["--max-steering-entries", str(POOL_ENTRIES)]
    arguments += [f"--{key.replace('_', '-')}={value}" for key, value in ENGINE.items()]
    traces = ["--traces", *(str(part) for bound in TRACE_BOUNDS.items() for part in bound)]
    certificate, key = tls_certificate(directory)
    tls = ["--ssl-certfile", str(certificate), "--ssl-keyfile", str(key)]
    ledger = directory / "device.jsonl"
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(FAKE_DEVICE), os.environ.get("PYTHONPATH")])),
        "NNTERP_TEST_DEVICE_LEDGER": str(ledger),
        "VLLM_SERVER_DEV_MODE": "1",
    }
    trusted = os.environ.get("SSL_CERT_FILE")
    os.environ["SSL_CERT_FILE"] = str(certificate)  # this module's clients trust the server's certificate
    server = Server(arguments + traces + tls, directory / "server.log", env=env, scheme="https")
    try:
        server.wait_ready()
        yield SimpleNamespace(
            certificate=certificate,
            ledger=ledger,
            server=server,
            url=server.url,
            arguments=arguments,
            directory=directory,
            vectors=found,
            steered=steered,
            chat_ids=chat_ids,
            single=single,
            expected=dict(zip(single, tokens)),
            per_layer=per_layer,
            kept={"plain": kept[0].activations, "chat steered": kept[1].activations},
            sae_kept=[output.activations for output in kept[2:]],
            concurrent=list(zip(concurrent, tokens[len(single) :])),
            traced=traced,
            swept=swept,
            probed=probed.probes["p"],
        )
    finally:
        server.stop()
        if trusted is None:
            os.environ.pop("SSL_CERT_FILE", None)
        else:
            os.environ["SSL_CERT_FILE"] = trusted


def test_probes_and_gated_specs_over_http_equal_the_steered_engines(served):
    """A request's ``probes`` come back in its choice, per kept token, as `SteeredVLLM.generate` reads them; a spec
    gated ``when`` a probe fires answers as the engine's; bad probes and gates are 400s naming the field."""
    probe = {"weight": SERVED_PROBE.weight[:, 0].tolist(), "bias": 0.1, "layer": 1}
    response = post(served, "/v1/completions", {"model": MODEL, "prompt": PROMPT, **GREEDY, "probes": {"p": probe}})
    assert response.status_code == 200, response.text
    torch.testing.assert_close(torch.tensor(response.json()["choices"][0]["probes"]["p"]), served.probed)
    gated = [
        {
            "layers": 1,
            "vector": served.vectors["inline"].tolist(),
            "factor": 3.0,
            "when": {"probe": probe, "op": ">", "threshold": 0.0},
        }
    ]
    assert completion_tokens(served, gated, False) == served.expected["gated"]
    for body, param in (
        ({"probes": {"p": {**probe, "weight": [1.0] * 7}}}, "probes.p.weight"),
        ({"probes": {"p": {**probe, "depth": 3}}}, "probes.p.depth"),
        ({"probes": {"p": probe}, "n": 2, "temperature": 1.0}, "n"),
        ({"steering": [{**gated[0], "when": {"probe": probe, "op": "==", "threshold": 0}}]}, "steering[0].when.op"),
    ):
        refused = post(served, "/v1/completions", {"model": MODEL, "prompt": PROMPT, **GREEDY, **body})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text


def streamed_choices(chunks: list[Any]) -> dict[int, dict[str, Any]]:
    """Per choice of a stream's chunks: its text, its tokens, and the probes of the chunks that carried any (with
    the finish reason of each of those chunks)."""
    choices: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            found = choices.setdefault(choice.index, {"text": "", "tokens": [], "probes": []})
            found["text"] += (choice.delta.content or "") if hasattr(choice, "delta") else choice.text
            found["tokens"] += getattr(choice, "token_ids", None) or []
            if getattr(choice, "probes", None) is not None:
                found["probes"].append((choice.finish_reason, choice.probes))
    return choices


def test_probes_on_streamed_responses_equal_the_whole_responses(served):
    """A streamed completion or chat completion carries each choice's ``probes`` in the chunk that finishes it, as
    the whole response carries them (the whole completion's as `SteeredVLLM.generate` reads them), beside the same
    tokens; a completion of several prompts, each its own choice's."""
    probe = {"weight": SERVED_PROBE.weight[:, 0].tolist(), "bias": 0.1, "layer": 1}
    body = {**EXTRA, "probes": {"p": probe}}
    prompts = [PROMPT, SAME_LENGTH]
    completions = client(served).completions
    whole = completions.create(model=MODEL, prompt=prompts, extra_body=body, **GREEDY)
    streamed = streamed_choices(
        list(completions.create(model=MODEL, prompt=prompts, stream=True, extra_body=body, **GREEDY))
    )
    torch.testing.assert_close(torch.tensor(whole.choices[0].probes["p"]), served.probed)
    assert sorted(streamed) == [choice.index for choice in whole.choices] == [0, 1]
    for choice in whole.choices:
        found = streamed[choice.index]
        assert (found["text"], found["tokens"]) == (choice.text, choice.token_ids)
        ((finish_reason, probes),) = found["probes"]
        assert finish_reason == choice.finish_reason == "length"
        torch.testing.assert_close(torch.tensor(probes["p"]), torch.tensor(choice.probes["p"]))
    chat = client(served).chat.completions
    whole = chat.create(model=MODEL, messages=MESSAGES, extra_body=body, **GREEDY)
    streamed = streamed_choices(
        list(chat.create(model=MODEL, messages=MESSAGES, stream=True, extra_body=body, **GREEDY))
    )
    ((finish_reason, probes),) = streamed[0]["probes"]
    (choice,) = whole.choices
    assert (streamed[0]["text"], streamed[0]["tokens"]) == (choice.message.content, choice.token_ids)
    assert finish_reason == choice.finish_reason == "length"
    assert len(probes["p"]) == len(whole.prompt_token_ids) + STEPS - 1  # every token fed in
    torch.testing.assert_close(torch.tensor(probes["p"]), torch.tensor(choice.probes["p"]))


def test_a_streamed_choice_carries_the_probes_of_its_own_prompt_whichever_finishes_first():
    """In a stream over several prompts, each choice's finishing chunk carries its own prompt's probes, also when it
    finishes first (its prompt the only one recorded yet) and when its event comes in two pieces; other chunks and
    ``[DONE]`` go out as they came."""
    # Per chunk: its choice, its finish reason, and the probes its engine request records just before it goes out.
    chunks = [(0, None, None), (1, "length", ("cmpl-x-1", [1.0])), (0, "length", ("cmpl-x-0", [0.0]))]

    async def app(scope, receive, send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for index, finish_reason, recorded in chunks:
            if recorded is not None:
                request_id, scores = recorded
                record(PROBES, request_id, {"p": scores})
            chunk = {"choices": [{"index": index, "finish_reason": finish_reason}]}
            event = f"data: {json.dumps(chunk)}\n\n".encode()
            for piece in (event[:9], event[9:]):
                await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    intake = RequestIntake(app, [RequestField(PROBES, ("/v1/completions",), lambda value: value, with_probes)], 2**20)

    async def streamed() -> str:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=intake), base_url="http://server") as http:
            response = await http.post("/v1/completions", json={"prompt": ["a", "b"], "probes": {"p": {}}})
            return response.text

    *events, done, end = asyncio.run(streamed()).split("\n\n")
    assert (done, end) == ("data: [DONE]", "")
    sent = [json.loads(event.removeprefix("data: "))["choices"][0] for event in events]
    assert [choice.get("probes") for choice in sent] == [None, {"p": [1.0]}, {"p": [0.0]}]


def test_a_patch_sweep_over_http_equals_the_steered_engines(served):
    """``POST /v1/patch_sweep`` answers the table `patch_sweep` gives on `SteeredVLLM` (the same cells, run in the
    server's continuous batch, the metric read in its worker); a bad metric is a 400 naming the field."""
    metric = {"kind": "recovered", "of": {"kind": "logit_diff", "correct": SWEPT_TOKENS[0], "wrong": SWEPT_TOKENS[1]}}
    response = post(served, "/v1/patch_sweep", {**SWEEP, "metric": metric})
    assert response.status_code == 200, response.text
    table = response.json()
    expected = served.swept
    assert (table["object"], table["metric"], table["layers"], table["positions"]) == (
        "patch_sweep",
        "recovered_logit_diff",
        expected.layers,
        expected.positions,
    )
    torch.testing.assert_close(torch.tensor(table["values"]), expected.values, atol=1e-4, rtol=1e-4)
    assert table["measured"]["clean"] == pytest.approx(expected.measured["clean"], abs=1e-4)
    bad = post(served, "/v1/patch_sweep", {**SWEEP, "metric": {"kind": "logit_diff", "correct": 3}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "metric.wrong"
    far = post(served, "/v1/patch_sweep", {**SWEEP, "metric": {"kind": "logprob", "token": 10**6}})
    assert far.status_code == 400 and "not in the vocabulary" in far.json()["error"]["message"]


def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0)


def completion_tokens(served, steering: list[dict] | None, stream: bool, model: str = MODEL) -> list[int]:
    body = {**EXTRA, **({"steering": steering} if steering is not None else {})}
    response = client(served).completions.create(model=model, prompt=PROMPT, stream=stream, extra_body=body, **GREEDY)
    chunks = list(response) if stream else [response]
    return [token for chunk in chunks for choice in chunk.choices for token in choice.token_ids or []]


def chat_tokens(served, steering: list[dict] | None, stream: bool, model: str = MODEL) -> tuple[list[int], list[int]]:
    """The generated tokens and the prompt's tokens as the server rendered them."""
    body = {**EXTRA, **({"steering": steering} if steering is not None else {})}
    response = client(served).chat.completions.create(
        model=model, messages=MESSAGES, stream=stream, extra_body=body, **GREEDY
    )
    chunks = list(response) if stream else [response]
    prompt = [t for c in chunks for t in (getattr(c, "prompt_token_ids", None) or [])]
    if stream:
        prompt += [t for c in chunks for choice in c.choices for t in (getattr(choice, "prompt_token_ids", None) or [])]
    return [t for c in chunks for choice in c.choices for t in (getattr(choice, "token_ids", None) or [])], prompt


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_steered_and_not_equal_the_steered_engine(served, stream):
    assert completion_tokens(served, None, stream) == served.expected["plain"]
    assert completion_tokens(served, [], stream) == served.expected["plain"]  # empty: unsteered
    assert completion_tokens(served, as_json(served.steered), stream) == served.expected["steered"]
    assert served.expected["steered"] != served.expected["plain"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_completions_steered_and_not_equal_the_steered_engine(served, stream):
    tokens, prompt = chat_tokens(served, None, stream)
    assert (tokens, prompt) == (served.expected["chat"], served.chat_ids)
    tokens, _ = chat_tokens(served, as_json(served.steered), stream)
    assert tokens == served.expected["chat steered"] != served.expected["chat"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_ablate_and_cap_entries_equal_the_steered_engine(served, stream):
    """A request adding, ablating a registered vector (by name) and capping an inline one answers as
    `SteeredVLLM.generate` with `Steering`, `Ablate` and `Cap` does."""
    _, specs = served.single["directions"]
    steering = as_json(specs, {1: "preloaded"})
    assert [field.get("kind", "add") for field in steering] == ["add", "ablate", "cap"]
    assert completion_tokens(served, steering, stream) == served.expected["directions"]
    assert served.expected["directions"] != served.expected["plain"]


def test_clamp_entries_equal_the_steered_engine(served):
    """A request clamping a standard and a TopK SAE's features (registered with --sae, by name) beside an added
    vector answers as `SteeredVLLM.generate` with the same `Clamp`s does."""
    _, specs = served.single["clamps"]
    steering = as_json(specs)
    assert [field.get("kind", "add") for field in steering] == ["clamp", "clamp", "add"]
    assert completion_tokens(served, steering, False) == served.expected["clamps"]
    assert served.expected["clamps"] != served.expected["plain"]


def test_patch_entries_equal_the_steered_engine(served):
    """A request patching a block's output and what its attention adds, at listed prompt positions, answers as
    `SteeredVLLM.generate` with the same `Patch`es does; a patch of a value the engine does not set is refused."""
    _, specs = served.single["patches"]
    steering = as_json(specs)
    assert [field["kind"] for field in steering] == ["patch", "patch"]
    assert completion_tokens(served, steering, False) == served.expected["patches"]
    assert served.expected["patches"] != served.expected["plain"]
    response = post(
        served,
        "/v1/completions",
        {"model": MODEL, "prompt": PROMPT, **GREEDY, "steering": [{**steering[0], "value": "logits"}]},
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "steering[0].value"


def test_models_health_and_usage_are_vllms(served):
    assert [model.id for model in client(served).models.list().data][0] == MODEL
    response = client(served).completions.create(model=MODEL, prompt=PROMPT, extra_body=EXTRA, **GREEDY)
    assert response.usage.prompt_tokens == len(PROMPT) and response.usage.completion_tokens == STEPS


def test_steered_models_are_listed_with_the_base_model_as_their_parent(served):
    listed = {model.id: model for model in client(served).models.list().data}
    assert list(listed) == [MODEL, "capped", "formal"]
    assert listed["formal"].parent == listed["capped"].parent == MODEL and listed[MODEL].parent is None
    recipes = httpx.get(served.url + "/v1/steering/models", headers=AUTH).json()["data"]
    assert [(entry["name"], entry["parent"]) for entry in recipes] == [("capped", MODEL), ("formal", MODEL)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("name", ["formal", "capped"])
def test_a_steered_name_answers_as_its_recipe_sent_as_steering(served, name, stream):
    """Asking for a steered model (a short-form recipe, a YAML file's) is the base model with the recipe as the
    request's steering, on completions and chat, whole and streamed; the response names the model asked for."""
    expected = completion_tokens(served, RECIPES[name], stream)
    assert completion_tokens(served, None, stream, model=name) == expected != served.expected["plain"]
    if name == "formal":
        assert expected == served.expected["formal"]
    assert chat_tokens(served, None, stream, model=name)[0] == chat_tokens(served, RECIPES[name], stream)[0]
    response = client(served).completions.create(model=name, prompt=PROMPT, stream=stream, **GREEDY)
    models = {chunk.model for chunk in response} if stream else {response.model}
    assert models == {name}


def test_a_steered_name_spelled_with_json_escapes_is_steered_as_plainly_spelled(served):
    """The intake reads a body only where it may name a steered model: a name spelled with ``\\u`` escapes is one."""
    body = json.dumps({"prompt": PROMPT, **GREEDY, **EXTRA}).replace("{", '{"model": "\\u0066ormal", ', 1)
    response = post(served, "/v1/completions", body.encode())
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == served.expected["formal"]


def test_a_steered_names_recipe_goes_before_the_requests_own_steering(served):
    own = as_json(served.steered)
    tokens = completion_tokens(served, own, stream=False, model="formal")
    assert tokens == completion_tokens(served, RECIPES["formal"] + own, stream=False)
    assert tokens not in (served.expected["formal"], served.expected["steered"])


def test_steered_models_registered_at_run_time_serve_every_steering_route_until_deleted(served):
    models_url = "/v1/steering/models"
    recipe = [{"kind": "ablate", "vector": "preloaded", "layers": "all"}, {"layers": 0, "vector": "control"}]
    created = post(served, models_url, {"name": "plainer", "steering": recipe})
    assert created.status_code == 201, created.text
    assert created.json() == {"object": "steering.model", "name": "plainer", "parent": MODEL, "steering": recipe}
    assert post(served, models_url, {"name": "plainer", "steering": recipe}).status_code == 200  # the same again
    conflict = post(served, models_url, {"name": "plainer", "recipe": "preloaded@0"})
    assert conflict.status_code == 409 and conflict.json()["error"]["param"] == "name"
    assert "plainer" in [model.id for model in client(served).models.list().data]
    assert completion_tokens(served, None, False, model="plainer") == completion_tokens(served, recipe, False)
    for path in STEERING_ROUTES:
        body = route_body(path, None)
        steered = post(served, path, {**body, "model": "plainer"})
        assert steered.status_code == 200, (path, steered.text)
        assert steered.json()["model"] == "plainer", path  # the response names the model asked for
        by_hand = post(served, path, {**body, "steering": recipe})
        assert route_texts(path, steered.json()) == route_texts(path, by_hand.json()), path
    for path in ("/v1/messages", "/v1/responses"):  # their streamed events carry the model inside an object
        events = post(served, path, {**route_body(path, None), "model": "plainer", "stream": True}).text
        named = re.findall(r'"model": ?"([^"]+)"', events)
        assert named and set(named) == {"plainer"}, (path, events[:2000])
    short = post(served, models_url, {"name": "shorter", "recipe": "preloaded@0-2:-1.5"})
    assert short.status_code == 201 and short.json()["steering"] == [
        {"kind": "add", "vector": "preloaded", "layers": [0, 1, 2], "factor": -1.5}
    ]
    for name in ("plainer", "shorter"):
        assert httpx.delete(served.url + f"{models_url}/{name}", headers=AUTH).json()["deleted"] is True
    unknown = post(served, "/v1/completions", {"model": "never-registered", "prompt": PROMPT})
    gone = post(served, "/v1/completions", {"model": "plainer", "prompt": PROMPT})
    assert gone.status_code == unknown.status_code == 404
    assert gone.json()["error"]["type"] == unknown.json()["error"]["type"]
    assert "plainer" in gone.json()["error"]["message"]
    missing = httpx.delete(served.url + f"{models_url}/plainer", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "name"


def test_the_registry_holds_at_most_its_capacity_of_steered_models(served):
    """Two steered models from the command line and three more fill the registry's room (--max-steering-vectors 5):
    the next new name is a 409 naming the bound and the fix; deleting one makes room again."""
    models_url = "/v1/steering/models"
    added = [f"room-{i}" for i in range(CAPACITY - 2)]
    try:
        for name in added:
            assert post(served, models_url, {"name": name, "recipe": "preloaded@1"}).status_code == 201
        full = post(served, models_url, {"name": "one-too-many", "recipe": "preloaded@1"})
        assert full.status_code == 409 and full.json()["error"]["param"] == "name"
        assert f"as many steered models as vectors at most ({CAPACITY}, --max-steering-vectors)" in full.text
        assert httpx.delete(served.url + f"{models_url}/{added.pop()}", headers=AUTH).status_code == 200
        assert post(served, models_url, {"name": "one-too-many", "recipe": "preloaded@1"}).status_code == 201
        added.append("one-too-many")
    finally:
        for name in added:
            httpx.delete(served.url + f"{models_url}/{name}", headers=AUTH)


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"name": "x", "steering": [{"vector": "preloaded", "layers": 9}]}, "steering[0].layers", "layers"),
        ({"name": "x", "steering": [{"vector": "nowhere", "layers": 1}]}, "steering", "no vector is registered"),
        (
            {"name": "x", "steering": [{"kind": "clamp", "sae": "res1", "feature": 10**6, "value": 1.0}]},
            "steering[0].feature",
            "features",
        ),
        ({"name": "x", "recipe": "preloaded@one"}, "recipe", r"VECTOR@LAYER\[:FACTOR\]"),
        ({"name": "x", "recipe": "preloaded@2-1"}, "recipe", "run backwards"),
        ({"name": "x", "recipe": "/etc/recipe.yaml"}, "recipe", "not a file's name"),
        ({"name": "x", "steering": [], "recipe": "preloaded@1"}, "steering", "exactly one"),
        ({"name": "x", "steering": []}, "steering", "at least one spec"),
        ({"name": MODEL, "recipe": "preloaded@1"}, "name", "base model's name"),
        ({"name": "a/b", "recipe": "preloaded@1"}, "name", "letters, digits"),
        ({"name": "x", "recipe": "preloaded@1", "factor": 2}, "factor", "unknown field 'factor'"),
        (b"{not json", None, "the body is not JSON"),
    ],
)
def test_bad_steered_model_registrations_are_refused_with_400_naming_the_field(served, body, param, message):
    response = post(served, "/v1/steering/models", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert re.search(message, error["message"]), error["message"]
    assert [model.id for model in client(served).models.list().data] == [MODEL, "capped", "formal"]


def concurrent_tokens(url: str, cases: list[tuple[str, list[Steering], dict[int, str]]]) -> list[list[int]]:
    """Each case's generated tokens, all sent at once by one asyncio ``openai`` client."""

    async def all_requests():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as aclient:

            async def one(prompt, specs, names):
                body = {**EXTRA, "steering": as_json(specs, names)}
                response = await aclient.completions.create(model=MODEL, prompt=prompt, extra_body=body, **GREEDY)
                return response.choices[0].token_ids

            return await asyncio.gather(*(one(*case) for case in cases))

    return asyncio.run(all_requests())


def test_64_concurrent_mixed_clients_each_get_their_own_result(served):
    results = concurrent_tokens(served.url, [case for case, _ in served.concurrent])
    assert results == [expected for _, expected in served.concurrent]
    unsteered = [expected for (_, specs, _), expected in served.concurrent if not specs]
    assert len(set(map(tuple, results))) > len(set(map(tuple, unsteered)))  # steering changed what it steered


def post(served, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        served.url + path, content=content, headers={"content-type": "application/json", **AUTH}, timeout=60
    )


def spec(**fields) -> dict:
    return {"layers": 1, "vector": [0.5] * tiny.SIZES["hidden_size"], **fields}


def clamp(**fields) -> dict:
    return {"kind": "clamp", "sae": "res1", "feature": 3, "value": 2.0, **fields}


HIDDEN = tiny.SIZES["hidden_size"]
BAD_STEERING = [
    ([spec(vector=[0.5] * 7)], "steering[0].vector", r"shape \[hidden_size\] = \[128\], got \[7\]"),
    ([spec(vector=[float("nan")] * HIDDEN)], "steering[0].vector", "NaN or inf"),
    ([spec(vector=[0.0] * (HIDDEN - 1) + [float("inf")])], "steering[0].vector", "NaN or inf"),
    ([spec(vector="never-registered")], "steering[0].vector", "no vector is registered as 'never-registered'"),
    ([spec(vector=["a"] * HIDDEN)], "steering[0].vector", "list of floats"),
    ([spec(vector={"x": 1})], "steering[0].vector", "a registered vector's name"),
    ([spec(), spec(layers=3)], "steering[1].layers", r"layer\(s\) \[3\] do not exist.*num_layers=3"),
    ([spec(layers="1")], "steering[0].layers", "layers must be an int"),
    ([spec(positions="decode")], "steering[0].positions", "positions must be"),
    ([spec(positions=[99])], "steering[0].positions", r"position\(s\) \[99\] are outside the sequence's"),
    ([spec(factor="x")], "steering[0].factor", "factor must be a finite number"),
    ([spec(factor=float("inf"))], "steering[0].factor", "factor must be a finite number"),
    ([spec(shift=2.0)], "steering[0].shift", "unknown field 'shift'"),
    ([spec(scale=2.0)], "steering[0].scale", r"scale must be one of 'absolute', 'relative'.*got 2.0"),
    ([spec(scale="percent")], "steering[0].scale", r"scale must be one of 'absolute', 'relative'.*got 'percent'"),
    ([spec(kind="cap", max=1.0, scale="relative")], "steering[0].scale", "'cap' specs have no field 'scale'"),
    ([spec(vector=[0.0] * HIDDEN, scale="relative")], "steering[0].vector", "nonzero, finite norm"),
    (
        [spec(kind="smear")],
        "steering[0].kind",
        "kind must be one of 'add', 'ablate', 'cap', 'clamp', 'patch', got 'smear'",
    ),
    ([spec(kind="clamp")], "steering[0].layers", "'clamp' specs have no field 'layers'"),
    ([clamp(sae="nope")], "steering[0].sae", r"no SAE is registered as 'nope'; this server holds res1, top2"),
    ([clamp(sae=None)], "steering[0].sae", "names a registered SAE"),
    ([clamp(feature=64)], "steering[0].feature", r"SAE 'res1' has 64 features \(0..63\), not 64"),
    ([clamp(feature=-1)], "steering[0].feature", "'feature' must be an int >= 0"),
    ([clamp(scale=2.0)], "steering[0]", "gives 'value' or 'scale', exactly one"),
    ([clamp(value="x")], "steering[0].value", "value must be a finite number"),
    ([clamp(positions=[99])], "steering[0].positions", r"position\(s\) \[99\] are outside the sequence's"),
    ([spec(kind="ablate", factor=2.0)], "steering[0].factor", "'ablate' specs have no field 'factor'"),
    ([spec(kind="cap", factor=2.0, max=1.0)], "steering[0].factor", "'cap' specs have no field 'factor'"),
    ([spec(min=1.0)], "steering[0].min", "'add' specs have no field 'min'"),
    ([spec(kind="cap")], "steering[0]", "clamps the projection to 'min', 'max' or both"),
    ([spec(kind="cap", min=1.0, max=0.0)], "steering[0].min", "min must not exceed max"),
    ([spec(kind="cap", max="x")], "steering[0].max", "max must be a finite number"),
    ([spec(kind="ablate", vector=[0.0] * HIDDEN)], "steering[0].vector", "nonzero, finite norm"),
    ([spec(layers="all")], "steering[0].layers", "layers must be an int"),
    ([spec(kind="ablate", layers="all", vector="control")], "steering[0].layers", "is a vector per layer"),
    (
        [spec(kind="ablate", vector=[0.5 + i] * HIDDEN) for i in range(3)],
        "steering",
        "cap, ablate or clamp 3 directions",
    ),
    ([{"layers": 1}], "steering[0].vector", "'vector' is required"),
    (["layer 1"], "steering[0]", "a steering spec is an object"),
    (spec(), "steering", "steering must be a list of specs"),
    (
        [spec(positions=[i], vector=[0.1 * (i + 1)] * tiny.SIZES["hidden_size"]) for i in range(POOL_ENTRIES + 1)],
        "steering",
        rf"need {POOL_ENTRIES + 1} distinct block contents of the engine's steering pool, which holds {POOL_ENTRIES}",
    ),
]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("steering, param, message", BAD_STEERING, ids=[b[1] + ":" + b[2][:24] for b in BAD_STEERING])
def test_bad_steering_is_refused_with_400_naming_the_field(served, endpoint, steering, param, message):
    prompt = {"prompt": PROMPT} if endpoint == "completions" else {"messages": MESSAGES}
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    response = post(served, path, {"model": MODEL, **prompt, **GREEDY, "steering": steering})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert re.search(message, error["message"]), error["message"]
    assert completion_tokens(served, as_json(served.steered), stream=False) == served.expected["steered"]


def test_the_openai_client_sees_the_refusal_as_bad_request(served):
    with pytest.raises(openai.BadRequestError) as refused:
        client(served).completions.create(
            model=MODEL, prompt=PROMPT, extra_body={"steering": [spec(layers=-9)]}, **GREEDY
        )
    assert refused.value.param == "steering[0].layers" and "num_layers=3" in refused.value.message
    assert completion_tokens(served, None, stream=False) == served.expected["plain"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": MODEL, "prompt": PROMPT, "vllm_xargs": {"nnterp_vllm_steering": "x"}}, "vllm_xargs"),
        ({"model": MODEL, "prompt": PROMPT, "use_beam_search": True, "n": 2, "steering": [spec()]}, "use_beam_search"),
    ],
)
def test_what_would_bypass_the_checks_is_refused(served, body, param):
    response = post(served, "/v1/completions", {**GREEDY, **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert completion_tokens(served, None, stream=False) == served.expected["plain"]


def test_the_registry_registers_lists_steers_and_forgets(served):
    vectors_url = "/v1/steering/vectors"
    listed = httpx.get(served.url + vectors_url, headers=AUTH).json()
    assert listed["data"] == [  # --steering-vectors: a file of named vectors, and a control vector made per layer
        {"object": "steering.vector", "name": "control", "size": HIDDEN, "layers": [0, 2]},
        {"object": "steering.vector", "name": "preloaded", "size": HIDDEN},
    ]
    posted = served.vectors["posted"].tolist()
    assert post(served, vectors_url, {"name": "posted", "vector": posted}).status_code == 201
    assert post(served, vectors_url, {"name": "posted", "vector": posted}).status_code == 200  # the same again
    conflict = post(served, vectors_url, {"name": "posted", "vector": [0.0] * HIDDEN})
    assert conflict.status_code == 409 and conflict.json()["error"]["param"] == "name"
    names = [entry["name"] for entry in httpx.get(served.url + vectors_url, headers=AUTH).json()["data"]]
    assert names == ["control", "posted", "preloaded"]
    steering = [{"layers": 0, "vector": "posted", "factor": 1.5}]
    assert completion_tokens(served, steering, stream=True) == served.expected["posted"]
    assert httpx.delete(served.url + vectors_url + "/posted", headers=AUTH).json()["deleted"] is True
    missing = httpx.delete(served.url + vectors_url + "/posted", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "name"
    refused = post(served, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "steering": steering})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "steering[0].vector"


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"name": "short", "vector": [1.0, 2.0]}, "vector", r"\[hidden_size\] = \[128\]"),
        ({"name": "nan", "vector": [float("nan")] * HIDDEN}, "vector", "NaN or inf"),
        ({"name": "a/b", "vector": [0.0] * HIDDEN}, "name", "letters, digits"),
        ({"name": 3, "vector": [0.0] * HIDDEN}, "name", "letters, digits"),
        ({"name": "x", "vector": "y"}, "vector", "list of 128 floats"),
        ({"name": "x", "vector": [0.0] * HIDDEN, "factor": 2}, "factor", "unknown field 'factor'"),
        (["x"], None, "the body is an object"),
        (b"{not json", None, "the body is not JSON"),
    ],
)
def test_bad_registrations_are_refused_with_400(served, body, param, message):
    response = post(served, "/v1/steering/vectors", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert re.search(message, error["message"]), error["message"]
    assert [e["name"] for e in httpx.get(served.url + "/v1/steering/vectors", headers=AUTH).json()["data"]] == [
        "control",
        "preloaded",
    ]


def test_a_vector_made_per_layer_steers_at_its_own_layers_by_file_and_by_post(served):
    """`--steering-vectors control=<repeng .gguf>` and a POST of ``{"name", "vector": {layer: [...]}}``: a spec naming
    either without layers applies it at its own layers, as `SteeredVLLM` does with `load_steering`'s specs."""
    assert completion_tokens(served, [{"vector": "control", "factor": 2.0}], stream=False) == served.expected["control"]
    body = {"name": "per-layer", "vector": {str(k): v.tolist() for k, v in served.per_layer.items()}}
    assert post(served, "/v1/steering/vectors", body).status_code == 201
    steering = [{"vector": "per-layer", "factor": -1.0, "positions": "generated"}]
    try:
        assert completion_tokens(served, steering, stream=True) == served.expected["per layer"]
        named = {"model": MODEL, "prompt": PROMPT, **GREEDY}
        for spec_, param, message in (
            ({"vector": "per-layer", "layers": 1}, "steering[0].layers", r"carries layers \[0, 2\], not \[1\]"),
            ({"vector": "preloaded"}, "steering[0].layers", "one vector, made for no layer: name the layers"),
            ({"vector": [0.5] * HIDDEN}, "steering[0].layers", "'layers' is required"),
        ):
            refused = post(served, "/v1/completions", {**named, "steering": [spec_]})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
            assert re.search(message, refused.json()["error"]["message"]), refused.text
        bad = post(served, "/v1/steering/vectors", {"name": "bad", "vector": {"x": [0.0] * HIDDEN}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "vector.x", bad.text
    finally:
        httpx.delete(served.url + "/v1/steering/vectors/per-layer", headers=AUTH)


def decoded(activations: dict) -> dict[str, torch.Tensor]:
    """A choice's ``activations`` as tensors: base64 of raw little-endian bytes, dtype and shape given."""
    import base64

    return {
        name: torch.frombuffer(
            bytearray(base64.b64decode(entry["data"])), dtype=getattr(torch, entry["dtype"])
        ).reshape(entry["shape"])
        for name, entry in activations.items()
    }


def test_capture_comes_back_in_each_choice_as_the_steered_engine_keeps_it(served):
    capture = {"values": [s.text for s in CAPTURED.values]}
    response = post(
        served, "/v1/completions", {"model": MODEL, "prompt": PROMPT, **GREEDY, **EXTRA, "capture": capture}
    )
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert choice["token_ids"] == served.expected["plain"]
    kept = decoded(choice["activations"])
    assert list(kept) == list(served.kept["plain"])
    for name, rows in served.kept["plain"].items():
        torch.testing.assert_close(kept[name], rows)
    chat = {"model": MODEL, "messages": MESSAGES, **GREEDY, **EXTRA, "steering": as_json(served.steered)}
    response = post(served, "/v1/chat/completions", {**chat, "capture": {**capture, "dtype": "float16"}})
    (choice,) = response.json()["choices"]
    kept = decoded(choice["activations"])
    for name, rows in served.kept["chat steered"].items():
        torch.testing.assert_close(kept[name], rows.half())  # the steered stream, kept in float16
    two = post(served, "/v1/completions", {"model": MODEL, "prompt": [PROMPT, "Other"], **GREEDY, "capture": capture})
    assert [len(c["activations"]) for c in two.json()["choices"]] == [2, 2]
    first = decoded(sorted(two.json()["choices"], key=lambda c: c["index"])[0]["activations"])
    torch.testing.assert_close(first["layers.1.layer_output"], served.kept["plain"]["layers.1.layer_output"])
    plain = post(served, "/v1/completions", {"model": MODEL, "prompt": PROMPT, **GREEDY, **EXTRA})
    assert "activations" not in plain.json()["choices"][0]


def test_sae_features_come_back_as_the_steered_engine_encodes_them(served):
    for capture, expected in zip(SAE_CAPTURES, served.sae_kept):
        field = {"values": [s.text for s in capture.values], "positions": capture.positions}
        field.update({"features": capture.features} if capture.features is not None else {"top_k": capture.top_k})
        body = {"model": MODEL, "prompt": PROMPT, **GREEDY, **EXTRA, "capture": field}
        response = post(served, "/v1/completions", body)
        assert response.status_code == 200, response.text
        kept = decoded(response.json()["choices"][0]["activations"])
        assert list(kept) == list(expected)
        for name, rows in expected.items():
            torch.testing.assert_close(kept[name], rows)
    assert served.sae_kept[0]["layers.2.sae_features.indices"].dtype == torch.int64


BAD_CAPTURES = [
    ({"capture": {"values": "layers.1.self_attn.attention_queries"}}, "capture.values", "not kept by the engine"),
    ({"capture": {"values": "layers.2.mlp_output"}}, "capture.values", "this server keeps no layers.2.mlp_output"),
    ({"capture": {"values": "layers.5.layer_output"}}, "capture.values", r"layer\(s\) \[5\] do not exist"),
    ({"capture": {"values": "layers.1.layer_output", "positions": [99]}}, "capture.positions", r"\[99\]"),
    ({"capture": {"values": "layers.1.layer_output", "dtype": "int8"}}, "capture.dtype", "floating torch dtype"),
    ({"capture": {"values": "layers.1.layer_output", "scale": 2}}, "capture.scale", "unknown field 'scale'"),
    ({"capture": ["layers.1.layer_output"]}, "capture", "capture is an object"),
    (
        {"capture": {"values": "layers.0.sae_features"}},
        "capture.values",
        "needs an SAE reading block 0's output; the engine holds res1 at block 1, top2 at block 2",
    ),
    ({"capture": {"values": "layers.1.sae_features", "top_k": 0}}, "capture.top_k", "top_k must be an int >= 1"),
    (
        {"capture": {"values": "layers.1.sae_features", "features": [70]}},
        "capture.features",
        r"features \[70\] do not exist in SAE 'res1'",
    ),
    ({"capture": {"values": "layers.1.layer_output"}, "stream": True}, "stream", "not served on streamed responses"),
    ({"capture": {"values": "layers.1.layer_output"}, "n": 2, "temperature": 1.0}, "n", "send n=1"),
    ({"capture": {"values": "layers.*.layer_output"}, "max_tokens": 200}, "capture", "--max-capture-bytes"),
]


@pytest.mark.parametrize("body, param, message", BAD_CAPTURES, ids=[b[1] + ":" + b[2][:20] for b in BAD_CAPTURES])
def test_bad_capture_is_refused_with_400_naming_the_field(served, body, param, message):
    response = post(served, "/v1/completions", {"model": MODEL, "prompt": PROMPT, **GREEDY, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and re.search(message, error["message"]), error
    assert completion_tokens(served, None, stream=False) == served.expected["plain"]


def test_capture_is_refused_where_a_route_cannot_carry_it(served):
    body = {**route_body("/v1/responses", None), "capture": {"values": "layers.1.layer_output"}}
    response = post(served, "/v1/responses", body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "capture", response.text
    assert "capture is not served on /v1/responses" in response.json()["error"]["message"]


def test_a_poisoning_request_is_refused_and_every_later_request_answers_as_before(served):
    """One request whose added vector float32 cannot hold (each number finite) used to turn every later
    request's output into ''; it is refused, naming the bound, and the next ones answer token for token."""
    poison = [{"layers": 1, "vector": [3e38] * HIDDEN, "factor": 10}]
    response = post(served, "/v1/completions", {"model": MODEL, "prompt": "Tell me a story", "steering": poison})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "steering" and "at layer 1" in error["message"] and "float32" in error["message"]
    assert "+-2.13e+37" in error["message"] and "lower the factor or the vector" in error["message"]
    assert completion_tokens(served, None, stream=False) == served.expected["plain"]
    assert completion_tokens(served, as_json(served.steered), stream=True) == served.expected["steered"]
    with_logprobs = client(served).completions.create(model=MODEL, prompt=PROMPT, logprobs=1, **GREEDY)
    assert all(math.isfinite(value) for value in with_logprobs.choices[0].logprobs.token_logprobs)


def test_the_api_key_guards_every_route_but_the_health_probes(served):
    open_paths = {"/health": 200, "/ping": 200}
    for path, status in open_paths.items():
        assert httpx.get(served.url + path).status_code == status
    guarded = [
        ("POST", "/invocations", {"model": MODEL, "prompt": PROMPT, "steering": [spec(vector="preloaded")]}),
        ("POST", "/invocations", {"model": MODEL, "prompt": PROMPT, "steering": [spec(vector="never-registered")]}),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": PROMPT}),
        ("POST", "/tokenize", {"model": MODEL, "prompt": PROMPT}),
        ("POST", "/detokenize", {"model": MODEL, "tokens": [5, 6]}),
        ("GET", "/metrics", None),
        ("GET", "/v1/models", None),
        ("GET", "/openapi.json", None),
        ("GET", "/v1/steering/vectors", None),
        ("DELETE", "/v1/steering/vectors/preloaded", None),
        ("DELETE", "/v1/steering/vectors/never-registered", None),
    ]
    answers = set()
    for method, path, body in guarded:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            response = httpx.request(method, served.url + path, json=body, headers=headers, timeout=60)
            assert response.status_code == 401, (method, path, response.text)
            answers.add(response.text)
    (answer,) = answers  # known and unknown names, every route: the same answer
    assert "Authorization: Bearer <key>" in answer and "--api-key" in answer
    listed = httpx.get(served.url + "/v1/steering/vectors", headers=AUTH).json()["data"]
    assert [entry["name"] for entry in listed] == ["control", "preloaded"]  # nothing was deleted
    assert completion_tokens(served, None, stream=False) == served.expected["plain"]


def route_body(path: str, steering: list[dict] | None) -> dict:
    """A request for ``MESSAGES`` (or ``PROMPT`` on /invocations, as a completion) on ``path``, greedy."""
    body = {"model": MODEL, "temperature": 0.0, **({"steering": steering} if steering is not None else {})}
    if path == "/v1/responses":
        return {**body, "input": MESSAGES[0]["content"], "max_output_tokens": STEPS}
    if path == "/v1/chat/completions/batch":
        return {**body, "messages": [MESSAGES, MESSAGES], "max_tokens": STEPS}
    if path in ("/invocations", "/v1/completions"):
        return {**body, "prompt": PROMPT, "max_tokens": STEPS, "return_token_ids": True}
    return {**body, "messages": MESSAGES, "max_tokens": STEPS}


def route_texts(path: str, answer: dict) -> list[str]:
    """The generated texts of a route's answer (on completions, the token ids)."""
    if path == "/v1/responses":
        items = [item for item in answer["output"] if item["type"] == "message"]
        return [part["text"] for item in items for part in item["content"] if part["type"] == "output_text"]
    if path == "/v1/messages":
        return [part["text"] for part in answer["content"] if part["type"] == "text"]
    if path in ("/invocations", "/v1/completions"):  # token ids: the text may be bytes that decode to nothing
        return [json.dumps(choice["token_ids"]) for choice in answer["choices"]]
    return [choice["message"]["content"] for choice in answer["choices"]]


#: Steering under which the tiny model's greedy answer to ``MESSAGES`` is printable text ('UUUU...'), so
#: routes that answer text only can be compared.
PRINTABLE_STEERING = [
    {"layers": 2, "vector": (torch.randn(HIDDEN, generator=torch.Generator().manual_seed(9)) * 4).tolist()}
]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses", "/v1/chat/completions/batch", "/invocations"])
def test_steering_applies_on_every_generation_route_as_on_completions(served, path):
    """Each route answers as /v1/chat/completions (or, on /invocations, /v1/completions) does for the same
    prompt and steering; a bad spec is refused with 400 naming it, before anything reaches the engine."""
    steering = PRINTABLE_STEERING
    reference = "/v1/completions" if path == "/invocations" else "/v1/chat/completions"
    expected = {}
    for name, field in (("plain", None), ("steered", steering)):
        answer = post(served, reference, route_body(reference, field)).json()
        expected[name] = route_texts(reference, answer)[0]
    assert expected["plain"] != expected["steered"] and expected["steered"]
    for name, field in (("plain", None), ("steered", steering)):
        response = post(served, path, route_body(path, field))
        assert response.status_code == 200, response.text
        texts = route_texts(path, response.json())
        assert texts and set(texts) == {expected[name]}, (name, texts, expected)
    refused = post(served, path, route_body(path, [spec(layers=7)]))
    assert refused.status_code == 400, refused.text
    assert "steering[0]: layer(s) [7] do not exist" in refused.text
    assert route_texts(path, post(served, path, route_body(path, steering)).json())[0] == expected["steered"]


@pytest.mark.parametrize("path", ["/tokenize", "/v1/messages/count_tokens", "/detokenize"])
def test_steering_on_a_route_that_cannot_carry_it_is_refused(served, path):
    body = {"model": MODEL, "prompt": PROMPT, "messages": MESSAGES, "tokens": [5], "steering": [spec()]}
    response = post(served, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "steering" and f"steering is not served on {path}" in error["message"]
    assert "/v1/completions" in error["message"]
    assert completion_tokens(served, as_json(served.steered), stream=False) == served.expected["steered"]


def test_too_many_specs_and_too_large_bodies_are_refused_before_they_are_parsed_whole(served):
    most = 4 * tiny.SIZES["num_hidden_layers"]  # the default: 4 per layer
    body = {"model": MODEL, "prompt": PROMPT, "steering": [spec(vector=[0.5] * 64)] * 10_000}  # 3.3 MB
    response, worst = while_another_client_asks(served, json.dumps(body).encode())
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "steering" and f"at most {most} per request (--max-steering-specs)" in error["message"]
    assert all(seconds < 1.0 for seconds in worst.values()), worst
    accepted = post(
        served, "/v1/completions", {"model": MODEL, "prompt": PROMPT, **GREEDY, "steering": [spec()] * most}
    )
    assert accepted.status_code == 200, accepted.text
    bound = body_bound(most)
    too_large = b'{"model": "tiny", "prompt": "' + b"a" * bound + b'"}'
    for content in (too_large, iter([too_large[: bound // 2], too_large[bound // 2 :]])):  # declared, then streamed
        response = httpx.post(served.url + "/v1/completions", content=content, headers=AUTH, timeout=60)
        assert response.status_code == 413, response.text
        assert f"larger than this server reads ({bound} bytes, --max-request-body-bytes)" in response.text
    registering = post(served, "/v1/steering/vectors", {"name": "huge", "vector": [0.5] * (bound // 4)})
    assert registering.status_code == 413
    bad_element = post(
        served, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "steering": [spec(vector=[0.5] * 127 + ["NaN"])]}
    )
    assert bad_element.status_code == 400 and "element 127 is 'NaN' (str)" in bad_element.json()["error"]["message"]
    assert completion_tokens(served, as_json(served.steered), stream=False) == served.expected["steered"]


def while_another_client_asks(served, content: bytes) -> tuple[httpx.Response, dict[str, float]]:
    """The answer to ``content`` sent to /v1/completions, and the longest wait of another client's /health
    and small completion, asked over and over while it is under way."""
    result = {}

    def send():
        headers = {"content-type": "application/json", **AUTH}
        result["response"] = httpx.post(served.url + "/v1/completions", content=content, headers=headers, timeout=120)

    sender = threading.Thread(target=send)
    sender.start()
    waits = {"health": [], "small completion": []}
    small = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    while sender.is_alive() or not waits["health"]:
        started = time.monotonic()
        assert httpx.get(served.url + "/health", timeout=30).status_code == 200
        waits["health"].append(time.monotonic() - started)
        started = time.monotonic()
        assert post(served, "/v1/completions", small).status_code == 200
        waits["small completion"].append(time.monotonic() - started)
    sender.join()
    return result["response"], {name: max(values) for name, values in waits.items()}


def body_bound(most: int) -> int:
    """The server's default body bound: 4 MiB plus ``most`` inline vectors at 25 bytes a number."""
    return 4 * 2**20 + most * HIDDEN * 25


def test_the_registry_holds_at_most_its_capacity(served):
    vectors_url = "/v1/steering/vectors"
    held = len(httpx.get(served.url + vectors_url, headers=AUTH).json()["data"])
    names = [f"fill-{i}" for i in range(CAPACITY - held)]
    for name in names:
        assert post(served, vectors_url, {"name": name, "vector": [0.25] * HIDDEN}).status_code == 201
    full = post(served, vectors_url, {"name": "one-more", "vector": [0.25] * HIDDEN})
    assert full.status_code == 409, full.text
    error = full.json()["error"]
    assert f"at most {CAPACITY} vectors (--max-steering-vectors)" in error["message"] and error["param"] == "name"
    assert post(served, vectors_url, {"name": names[0], "vector": [0.25] * HIDDEN}).status_code == 200  # held already
    for name in names:
        assert httpx.delete(served.url + f"{vectors_url}/{name}", headers=AUTH).status_code == 200
    assert post(served, vectors_url, {"name": "one-more", "vector": [0.25] * HIDDEN}).status_code == 201
    assert httpx.delete(served.url + f"{vectors_url}/one-more", headers=AUTH).status_code == 200


def test_the_largest_accepted_request_stalls_no_other_client(served):
    """While one client sends a body at the bound with the most inline specs, /health and another client's
    small completion each answer within a second."""
    most = 4 * tiny.SIZES["num_hidden_layers"]
    vector = [-1.2345678901234567e-05] * HIDDEN  # the longest a number is written
    body = {"model": MODEL, "prompt": PROMPT, **GREEDY, "steering": [spec(vector=vector)] * most}
    body["user"] = "u" * (body_bound(most) - len(json.dumps(body)) - 64)  # OpenAI's free-text field fills the rest
    content = json.dumps(body).encode()
    assert body_bound(most) - 64 <= len(content) <= body_bound(most)
    response, worst = while_another_client_asks(served, content)
    assert response.status_code == 200, response.text
    assert all(seconds < 1.0 for seconds in worst.values()), worst


def metrics(served) -> dict[str, float]:
    """vLLM's Prometheus counters and gauges, summed over labels."""
    found: dict[str, float] = {}
    for line in httpx.get(served.url + "/metrics", headers=AUTH).text.splitlines():
        if line.startswith("vllm:"):
            name, value = line.rsplit(" ", 1)
            found[name.split("{")[0]] = found.get(name.split("{")[0], 0.0) + float(value)
    return found


# -- traces (--traces): nnsight's own client, unchanged ------------------------------------------------------


@pytest.fixture(scope="module")
def trace_client(served):
    """A client's model: no weights, no engine; each trace is sent to the server with nnsight's client."""
    return StandardizedVLLM(tiny.checkpoint("llama"), **ENGINE)


@pytest.fixture(scope="module")
def transformers_model():
    return StandardizedTransformer(tiny.checkpoint("llama"))


def close_all(actual, expected, tolerance: float) -> None:
    for got, want in zip(actual, expected, strict=True):
        torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)


def test_a_trace_sent_to_the_server_equals_the_local_engine_and_transformers(served, trace_client, transformers_model):
    sent = trace_experiment(trace_client, serve=served.url, api_key=KEY)
    assert trace_client.vllm_entrypoint is None  # a sent trace never starts an engine here
    close_all(sent, served.traced, 1e-6)
    close_all(sent, trace_experiment(transformers_model), 1e-4)


def rpc(served, method: str) -> list:
    """Each engine worker's answer to ``method`` (vLLM's development route ``/collective_rpc``)."""
    response = httpx.post(served.url + "/collective_rpc", json={"method": method}, headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["results"]


def captured_completion(served) -> tuple[list[int], dict[str, torch.Tensor]]:
    """A completion keeping `CAPTURED`'s values: its tokens and its kept rows."""
    capture = {"values": [s.text for s in CAPTURED.values]}
    response = post(
        served, "/v1/completions", {"model": MODEL, "prompt": PROMPT, **GREEDY, **EXTRA, "capture": capture}
    )
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    return choice["token_ids"], decoded(choice["activations"])


def test_8_concurrent_traces_beside_openai_steered_and_capturing_requests_each_get_their_own(
    served, trace_client, transformers_model
):
    """Traces share the engine's batch with the OpenAI routes' requests, in steps of their own: those run eagerly
    (with nnsight's interleaving), the others stay compiled, and steering and capture answer as on the steered
    engine."""
    traces: dict[int, tuple] = {}
    completions: dict[str, list[int]] = {}
    kept: dict[str, dict[str, torch.Tensor]] = {}

    def send(index: int) -> None:
        traces[index] = client_trace(trace_client, index, serve=served.url, api_key=KEY)

    def complete(name: str, steering: list[dict] | None) -> None:
        completions[name] = completion_tokens(served, steering, stream=False)

    def capture() -> None:
        completions["captured"], kept["plain"] = captured_completion(served)

    (before,) = rpc(served, "step_kinds")
    threads = [threading.Thread(target=send, args=(index,)) for index in range(len(TRACE_PROMPTS))]
    threads += [
        threading.Thread(target=complete, args=("plain", None)),
        threading.Thread(target=complete, args=("steered", as_json(served.steered))),
        threading.Thread(target=capture),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    (after,) = rpc(served, "step_kinds")
    assert completions == {name: served.expected[name] for name in ("plain", "steered")} | {
        "captured": served.expected["plain"]
    }
    for name, rows in served.kept["plain"].items():
        torch.testing.assert_close(kept["plain"][name], rows)
    assert sorted(traces) == list(range(len(TRACE_PROMPTS)))
    for index, sent in traces.items():
        close_all(sent, client_trace(transformers_model, index), 1e-4)
    assert after["eager"] > before["eager"] and after["compiled"] > before["compiled"], (before, after)
    # The scheduler kept the other requests out of the steps running trace code.
    assert after["eager beside others"] == before["eager beside others"], (before, after)
    assert rpc(served, "nnsight_request_count") == ["0"]  # every trace's worker went with its request


def test_the_server_holds_one_engine_that_starts_in_its_default_share_of_an_80_gb_device(served):
    """One engine, one rank: the stand-in accelerator's ledger (each worker's share as vLLM's GPU worker checks it)
    holds one share, vLLM's default, taken by the server's one engine process (its worker runs in it)."""
    from vllm.config import CacheConfig

    (share,) = [json.loads(line) for line in served.ledger.read_text().splitlines()]
    assert share["requested"] == math.ceil(80 * 10**9 * CacheConfig().gpu_memory_utilization)
    assert len(rpc(served, "step_kinds")) == 1  # one worker answers
    processes = session_processes(served.server.process.pid)
    assert [process.pid for process in processes if "EngineCore" in " ".join(process.cmdline())] == [share["pid"]]


def test_the_stand_in_device_refuses_a_second_engine_as_vllms_gpu_worker_does(tmp_path):
    """What would have kept a server of two engines (a trace engine beside the steered one) from starting."""
    import importlib.util

    from vllm.config import CacheConfig

    spec = importlib.util.spec_from_file_location("fake_device", FAKE_DEVICE / "sitecustomize.py")
    device = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(device)
    ledger = str(tmp_path / "device.jsonl")
    device.request(ledger, CacheConfig())
    with pytest.raises(ValueError, match=r"Free memory on device cuda:0 \(stand-in\) .* is less than desired"):
        device.request(ledger, CacheConfig(gpu_memory_utilization=0.5))


def test_the_server_speaks_tls_and_its_clients_verify_it(served, trace_client, monkeypatch):
    """The module's every request went over TLS; a client that does not trust the server's certificate (httpx's
    default, as nnsight's client and the trace client use it) refuses it, and sends nothing."""
    assert served.url.startswith("https://") and httpx.get(served.url + "/health").status_code == 200
    monkeypatch.delenv("SSL_CERT_FILE")
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(served.url + "/health")
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        with trace_client.trace(PROMPT, serve=served.url, api_key=KEY):
            trace_client.layers[0].layer_output.save()


def test_a_key_sent_over_plain_http_to_another_machine_is_warned_about_once(trace_client):
    def send(url: str) -> None:
        with pytest.raises(httpx.ConnectError):
            with trace_client.trace(PROMPT, serve=url, api_key=KEY):
                trace_client.layers[0].layer_output.save()

    with pytest.warns(UserWarning, match=r"API key goes to trace-server\.invalid over plain HTTP.*--ssl-keyfile"):
        send("http://trace-server.invalid:8000")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        send("http://trace-server.invalid:8000")  # once per host
        send(f"http://127.0.0.1:{free_port()}")  # this machine's loopback: nothing on the way
    assert not [warning for warning in caught if "plain HTTP" in str(warning.message)]


class AnswerServer:
    """A trace server that answers every trace with the same bytes, on a loopback port."""

    def __init__(self, answer: bytes) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Answer(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                self.rfile.read(int(self.headers.get("content-length", 0)))
                self.send_response(200)
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_an_answer_that_would_run_code_is_refused_by_the_client_and_runs_nothing(trace_client, tmp_path):
    from nnterp_vllm.errors import UnsafeAnswer

    marker = tmp_path / "written-by-the-answer"
    crafted = io.BytesIO()
    torch.save({"saves": {"probs": WritesAFile(marker)}, "error": None}, crafted)
    answers = {
        crafted.getvalue(): r"names io\.open, which this client does not load",
        pickle.dumps({"saves": {"probs": WritesAFile(marker)}}): "not in torch.save's format",
    }
    for answer, message in answers.items():
        server = AnswerServer(answer)
        try:
            with pytest.raises(UnsafeAnswer, match=message):
                with trace_client.trace(PROMPT, serve=server.url, api_key=KEY):
                    probs = trace_client.next_token_probs.save()
        finally:
            server.close()
        assert not marker.exists()
    assert pickle.loads(pickle.dumps(WritesAFile(marker))) and marker.exists()  # what the payload does when run
    with pytest.raises(NameError):
        probs  # noqa: B018 - nothing of the refused answers reached the caller


def peak_memory(pid: int) -> int:
    """The process's resident memory at its highest since its peak was last reset, in bytes."""
    line = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def test_a_trace_saving_past_the_bound_is_stopped_as_it_saves_and_the_server_holds_no_more(served, trace_client):
    """Each generated step saves 4 MiB, 12 steps asked for (50 MB): the engine counts the saves as the steps make
    them and stops the trace at the step that passes --max-saved-bytes (8 MB, the second); the server's resident
    memory grows by less than the bound and one step's values (and what the allocator keeps around them)."""
    bound, rows = TRACE_BOUNDS["--max-saved-bytes"], 8192
    step = rows * HIDDEN * 4
    assert served.expected["plain"][0] != tiny.SIZES["eos_token_id"]  # the generation reaches its second step

    def saving(steps: int) -> list[torch.Tensor]:
        with trace_client.generate(PROMPT, max_new_tokens=steps, serve=served.url, api_key=KEY) as tracer:
            kept = list().save()
            for _ in tracer.iter[:steps]:
                kept.append(trace_client.layers[1].layer_output[0, -1:].expand(rows, -1).clone())
        return kept

    assert [tuple(value.shape) for value in saving(1)] == [(rows, HIDDEN)]  # under the bound: handed back
    pid = served.server.process.pid
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak starts again from what the server holds now
    before = peak_memory(pid)
    with pytest.raises(ConnectionError, match=rf"413.*more than this engine hands back \({bound} bytes\)"):
        saving(12)
    grown = peak_memory(pid) - before
    assert grown < bound + step + 32 * 2**20, grown
    close_all(trace_experiment(trace_client, serve=served.url, api_key=KEY), served.traced, 1e-6)


def test_a_notebooks_async_engine_runs_the_servers_runner(served, transformers_model):
    """``StandardizedVLLM(..., mode="async")`` in a notebook runs on the worker (and runner) the server's engine
    runs, its trace's saves arriving on the finished output."""
    from nnterp_vllm.engines.steered.steered_settings import steering_settings

    path = tiny.checkpoint("llama")
    model = StandardizedVLLM(path, mode="async", dispatch=True, **ENGINE)
    try:
        worker = model.vllm_entrypoint.vllm_config.parallel_config.worker_cls
        assert worker == steering_settings(path, dict(ENGINE))["worker_cls"]
        with model.trace(PROMPT) as tracer:
            resid = model.layers[2].layer_output[:, -1].save()

        async def finished():
            return await tracer.backend

        output = asyncio.run(finished())
    finally:
        model.shutdown()
    with transformers_model.trace(PROMPT):
        truth = transformers_model.layers[2].layer_output[:, -1].save()
    torch.testing.assert_close(output.saves["resid"], truth, atol=1e-4, rtol=1e-4)
    with pytest.raises(NameError):
        resid  # noqa: B018 - an async trace's saves are on its output only (nnsight's async backend)


class WritesAFile:
    """Unpickled, it creates the file at ``path`` (what a server that deserialized it would do)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def test_a_trace_without_the_key_is_answered_401_and_never_deserialized(
    served, trace_client, transformers_model, tmp_path
):
    marker = tmp_path / "written-by-the-server"
    body = pickle.dumps(WritesAFile(marker))
    keys = ({}, {"ndif-api-key": "wrong"}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY})
    for path in ("/v1/nnsight/generate", "/v1/nnsight/register/an-edit"):
        for headers in keys:
            response = httpx.post(
                served.url + path, content=body, headers={"Content-Type": "application/octet-stream", **headers}
            )
            assert response.status_code == 401, response.text
            assert "ndif-api-key: <key>" in response.json()["detail"]
    assert not marker.exists()
    with pytest.raises(ConnectionError, match="401.*ndif-api-key"):
        with trace_client.trace(PROMPT, serve=served.url):
            trace_client.layers[0].layer_output.save()
    with trace_client.trace(PROMPT, serve=served.url, api_key=KEY):  # the key as nnsight's client sends it
        probs = trace_client.next_token_probs.save()
    with transformers_model.trace(PROMPT):
        truth = transformers_model.next_token_probs.save()
    torch.testing.assert_close(probs, truth, atol=1e-4, rtol=1e-4)


def filled_by_invokes(model, **send) -> tuple[list, dict]:
    """A list and a dict made before a trace, each filled by both of its invokes."""
    rows, by_prompt = [torch.zeros(1)], {}
    with model.trace(**send) as tracer:
        with tracer.invoke(PROMPT):
            rows.append(model.layers[1].layer_output[0, -1].save())
            by_prompt["first"] = model.layers[2].layer_output[0, -1].save()
        with tracer.invoke(SAME_LENGTH):
            rows.append(model.layers[1].layer_output[0, -1].save())
            by_prompt["second"] = model.layers[2].layer_output[0, -1].save()
    return rows, by_prompt


def test_a_list_and_a_dict_several_invokes_fill_come_back_with_every_invokes_items(
    served, trace_client, transformers_model
):
    # Another trace with invokes, from this same file, runs first: each trace is read from its own source.
    close_all(trace_experiment(trace_client, serve=served.url, api_key=KEY), served.traced, 1e-6)
    rows, by_prompt = filled_by_invokes(trace_client, serve=served.url, api_key=KEY)
    truth_rows, truth_by_prompt = filled_by_invokes(transformers_model)
    assert len(rows) == 3 and sorted(by_prompt) == ["first", "second"]
    close_all(rows, truth_rows, 1e-4)
    close_all([by_prompt["first"], by_prompt["second"]], [truth_by_prompt["first"], truth_by_prompt["second"]], 1e-4)


def last_token_output(model, **send) -> torch.Tensor:
    with model.trace(PROMPT, **send):
        output = model.layers[2].layer_output[:, -1].save()
    return output


def test_an_edit_left_on_the_server_runs_for_its_own_key_only_and_only_that_key_clears_it(
    served, trace_client, transformers_model
):
    plain = last_token_output(trace_client, serve=served.url, api_key=KEY)
    with transformers_model.trace(PROMPT):
        transformers_model.layers[1].layer_output[:, -1] *= 0.5
        halved = transformers_model.layers[2].layer_output[:, -1].save()
    with trace_client.edit(serve=served.url, api_key=KEY, name="halve") as (_, edit):
        trace_client.layers[1].layer_output[:, -1] *= 0.5
    try:
        close_all([last_token_output(trace_client, serve=served.url, api_key=KEY)], [halved], 1e-4)
        close_all([last_token_output(trace_client, serve=served.url, api_key=KEY, edits=["halve"])], [halved], 1e-4)
        # Another key's traces never run it, and that key cannot clear it (not even naming the first key in the
        # header it does not authenticate with).
        close_all([last_token_output(trace_client, serve=served.url, api_key=OTHER_KEY)], [plain], 1e-6)
        cleared = httpx.post(
            f"{served.url}/v1/nnsight/register/{edit.id}/clear",
            headers={"Authorization": f"Bearer {OTHER_KEY}", "ndif-api-key": KEY},
        )
        assert cleared.status_code == 200, cleared.text
        close_all([last_token_output(trace_client, serve=served.url, api_key=KEY)], [halved], 1e-4)
        with pytest.raises(ValueError, match=r"names \['double'\].*installed: \['halve'\]"):
            last_token_output(trace_client, serve=served.url, api_key=KEY, edits=["double"])
        with pytest.raises(ValueError, match=r"names \['halve'\].*with this API key \(installed: \[\]\)"):
            last_token_output(trace_client, serve=served.url, api_key=OTHER_KEY, edits=["halve"])
    finally:
        edit.clear()
    close_all([last_token_output(trace_client, serve=served.url, api_key=KEY)], [plain], 1e-6)
    broken = httpx.post(f"{served.url}/v1/nnsight/register/broken", content=b"no block", headers={"ndif-api-key": KEY})
    assert broken.status_code == 400 and "the edit could not be installed" in broken.json()["detail"]
    close_all([last_token_output(trace_client, serve=served.url, api_key=KEY)], [plain], 1e-6)


def test_a_trace_past_a_bound_is_answered_with_the_bound_and_the_server_goes_on(served, trace_client):
    large = torch.randn(TRACE_BOUNDS["--max-trace-bytes"] // 4 + 1000)
    with pytest.raises(ConnectionError, match=r"413.*2000000 bytes, --max-trace-bytes"):
        with trace_client.trace(PROMPT, serve=served.url, api_key=KEY):
            trace_client.layers[0].layer_output[:, -1] += large[:128]
    with pytest.raises(ConnectionError, match=r"413.*2000000 bytes, --max-trace-bytes"):
        with trace_client.edit(serve=served.url, api_key=KEY):
            trace_client.layers[0].layer_output[:, -1] += large[:128]
    with pytest.raises(ConnectionError, match=r"413.*--max-saved-bytes"):
        with trace_client.trace(PROMPT, serve=served.url, api_key=KEY):
            _large = trace_client.layers[0].layer_output.expand(3000, -1, -1).clone().save()
    started = time.monotonic()
    with pytest.raises(ConnectionError, match=r"408.*4 s, --trace-timeout"):
        with trace_client.generate(PROMPT, max_new_tokens=5, serve=served.url, api_key=KEY) as tracer:
            for _ in tracer.iter[:5]:
                time.sleep(1.5)  # each step held up; the request is aborted after the step it is in
    assert time.monotonic() - started < 6
    close_all(trace_experiment(trace_client, serve=served.url, api_key=KEY), served.traced, 1e-6)


def test_a_traces_own_error_reaches_its_client_only_with_its_type(served, trace_client):
    raised: dict[str, BaseException] = {}
    sent: dict[str, tuple] = {}

    def run(name: str, body) -> None:
        try:
            sent[name] = body()
        except Exception as error:  # noqa: BLE001 - each client's own error is what is checked
            raised[name] = error

    def own_exception():
        with trace_client.trace(PROMPT, serve=served.url, api_key=KEY):
            trace_client.layers[0].layer_output.save()
            raise KeyError("the trace's own")

    def bad_write():
        with trace_client.trace(PROMPT, serve=served.url, api_key=KEY):
            trace_client.layers[1].layer_output[:, 999] = 0

    def good():
        return trace_experiment(trace_client, serve=served.url, api_key=KEY)

    threads = [
        threading.Thread(target=run, args=("own", own_exception)),
        threading.Thread(target=run, args=("write", bad_write)),
        threading.Thread(target=run, args=("good", good)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert "KeyError" in str(raised["own"]) and "the trace's own" in str(raised["own"])
    assert isinstance(raised["write"], IndexError) and "999" in str(raised["write"])
    close_all(sent["good"], served.traced, 1e-6)


def test_a_client_that_disconnects_mid_stream_frees_its_request(served):
    tokens = 256 - len(PROMPT) - 1
    before = metrics(served)["vllm:generation_tokens_total"]
    body = {"model": MODEL, "prompt": PROMPT, "stream": True, "max_tokens": tokens, "ignore_eos": True}
    body["steering"] = as_json(served.steered)
    with httpx.stream("POST", served.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as response:
        assert next(line for line in response.iter_lines() if line.startswith("data: "))  # generating; hang up
    deadline = time.monotonic() + 30
    while (now := metrics(served))["vllm:num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert now["vllm:num_requests_running"] == now["vllm:num_requests_waiting"] == 0
    assert now["vllm:generation_tokens_total"] - before < tokens  # aborted, not run to its end
    assert completion_tokens(served, as_json(served.steered), stream=True) == served.expected["steered"]


def test_sigterm_drains_in_flight_requests_and_exits_cleanly(served):
    """Runs after every other test of the server: it stops it."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, headers=AUTH, timeout=120) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        served.server.terminate()
        rest = [line for line in lines if line.startswith("data: ")]
    chunks = [json.loads(line[6:]) for line in [first, *rest] if line != "data: [DONE]"]
    assert rest[-1] == "data: [DONE]", rest[-3:]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]  # drained
    assert served.server.stop() == 0
    served.server.assert_left_nothing()


@pytest.mark.scale
def test_two_replicas_on_ray_serve_answer_steered_requests(served):
    """``--replicas 2`` on a local Ray cluster the server starts (and stops on SIGTERM); without ``--traces``."""
    home = Path.home() / ".ray"
    before = set(home.rglob("*")) if home.exists() else set()
    server = Server(
        served.arguments + ["--replicas", "2", "--metrics-without-api-key"],
        served.directory / "replicas.log",
        env={"RAY_DEDUP_LOGS": "0"},
    )
    try:
        server.wait_ready()
        assert httpx.get(server.url + "/metrics").status_code == 200  # open for scrapers, with the flag
        assert httpx.get(server.url + "/v1/models").status_code == 401
        replicas = SimpleNamespace(**{**vars(served), "url": server.url})
        vectors_url = "/v1/steering/vectors"
        assert post(replicas, vectors_url, {"name": "posted", "vector": served.vectors["posted"].tolist()}).is_success

        cases = [case for case, _ in served.concurrent[:16]]
        cases += [(PROMPT, [Steering(0, served.vectors["posted"], factor=1.5)], {0: "posted"})] * 4
        results = concurrent_tokens(server.url, cases)
        assert results == [expected for _, expected in served.concurrent[:16]] + [served.expected["posted"]] * 4
        # A steered model registered through one replica serves on every one (one registry for all).
        assert post(replicas, "/v1/steering/models", {"name": "posted-model", "recipe": "posted@0:1.5"}).is_success
        for _ in range(4):
            assert completion_tokens(replicas, None, False, model="posted-model") == served.expected["posted"]
            assert completion_tokens(replicas, None, False, model="formal") == served.expected["formal"]
    finally:
        status = server.stop(timeout=180)
    assert status == 0, server.log.read_text()[-5000:]
    server.assert_left_nothing()
    assert (set(home.rglob("*")) if home.exists() else set()) == before  # no auth token written


def test_an_async_client_works_after_nnsight_is_imported():
    """anyio's attribute sets would fail to define once nnsight is imported; ``import nnterp_vllm``, before
    or after nnsight, keeps them working."""
    code = (
        "import asyncio, nnsight, nnterp_vllm, httpx\n"
        "async def main():\n"
        "    async with httpx.AsyncClient() as client:\n"
        "        try:\n"
        "            await client.get('http://127.0.0.1:9/')\n"
        "        except httpx.ConnectError:\n"
        "            pass\n"
        "asyncio.run(main())\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--replicas", "0"], "--replicas must be >= 1, got 0"),
        (["--api-server-count", "2"], "--api-server-count is not served with steering"),
        (["--data-parallel-size", "2"], "--data-parallel-size is not served with steering"),
        (["--headless"], "--headless is not served with steering"),
        (["--sae", "res1"], r"--sae takes NAME=DIR \(a name, then a SAELens SAE directory\), got 'res1'"),
        (["--sae", "res1=/nowhere"], "SAE.load: /nowhere is not a directory"),
        (["--traces"], "--traces without --api-key would run code sent by anyone who reaches every interface"),
        (["--traces", "--host", "0.0.0.0"], r"reaches --host 0\.0\.0\.0: give --api-key, or serve on a loopback"),
        (["--traces", "--api-key", "k", "--replicas", "2"], "--traces is served by one server"),
        (["--trace-timeout", "0"], "--trace-timeout must be > 0, got 0"),
        (["--max-saved-bytes", "-1"], "--max-saved-bytes must be > 0, got -1"),
    ],
)
def test_what_the_server_cannot_serve_is_refused_as_the_command_line_is_read(flags, message):
    from nnterp_vllm.serve.command_line import parse

    with pytest.raises(ValueError, match=message):
        parse([str(tiny.checkpoint("llama")), *flags])


def test_the_steering_pools_size_comes_from_the_command_line():
    from nnterp_vllm.serve.command_line import parse
    from nnterp_vllm.serve.server import engine_args

    path = str(tiny.checkpoint("llama"))
    settings = engine_args(parse([path, "--steering-directions-per-block", "3", "--max-steering-entries", "40"]))
    chosen = settings.additional_config["nnterp_vllm_steering"]
    assert (chosen["directions_per_block"], chosen["max_steering_entries"]) == (3, 40)
    assert engine_args(parse([path])).additional_config["nnterp_vllm_steering"]["directions_per_block"] == 2
    with pytest.raises(ValueError, match="steering_directions_per_block must be an int >= 1, got 0"):
        engine_args(parse([path, "--steering-directions-per-block", "0"]))
    with pytest.raises(ValueError, match="max_steering_entries must be an int >= 0, got -1"):
        engine_args(parse([path, "--max-steering-entries", "-1"]))


def bad_sources(tmp_path: Path) -> list[tuple[list[str], str]]:
    """``--steering-vectors`` entries of every kind, each wrong in one way, and what the refusal names."""
    files = {
        "short": {"short": torch.zeros(7)},
        "nan": {"nan": torch.full((HIDDEN,), float("nan"))},
        "rows": {"rows": torch.zeros(2, HIDDEN)},
        "name": {"a b": torch.zeros(HIDDEN)},
        "narrow": {"layer_activations.1": torch.zeros(7)},
    }
    for name, tensors in files.items():
        save_file(tensors, str(tmp_path / f"{name}.safetensors"))
    (tmp_path / "text.txt").write_text("not a vector")
    torch.save({"activations": {1: torch.zeros(HIDDEN)}}, tmp_path / "keys.pt")
    control = control_vector_file(tmp_path / "control.gguf", {1: torch.zeros(HIDDEN)})
    return [
        ([str(tmp_path / "short.safetensors")], r"vector 'short'.*\[hidden_size\] = \[128\]"),
        ([str(tmp_path / "nan.safetensors")], "NaN or inf"),
        ([str(tmp_path / "rows.safetensors")], r"\[hidden_size\] = \[128\]"),
        ([str(tmp_path / "name.safetensors")], "a vector's name is 1 to 128 letters"),
        ([f"v={tmp_path / 'narrow.safetensors'}"], r"vector 'v'.*\[hidden_size\] = \[128\]"),
        ([str(tmp_path / "text.txt")], "text.txt is none of the formats"),
        ([f"k={tmp_path / 'keys.pt'}"], r"keys.pt: .*'layer_activations'"),
        ([f"x={tmp_path / 'short.safetensors'}"], "holds named vectors, registered under their own names"),
        ([f"c={control}", f"c={control}"], "two entries register 'c'"),
        ([f"a b={control}"], "a vector's name is 1 to 128 letters"),
        ([f"c={tmp_path / 'missing.gguf'}"], "missing.gguf does not exist"),
    ]


def test_bad_steering_vectors_sources_are_refused_naming_the_entry(tmp_path):
    from nnterp_vllm.serve.vector_registration import read_vector_sources

    for entries, message in bad_sources(tmp_path):
        with pytest.raises(ValueError, match=f"--steering-vectors {re.escape(entries[-1])}: .*{message}"):
            read_vector_sources(entries, HIDDEN, 8)
    control = control_vector_file(tmp_path / "control.gguf", {0: torch.ones(HIDDEN), 2: torch.zeros(HIDDEN)})
    read = read_vector_sources([f"{tmp_path / 'control.gguf'}"], HIDDEN, 8)
    assert list(read) == ["control"] and sorted(read["control"]) == [0, 2] and control.exists()
    with pytest.raises(ValueError, match="2 vectors, more than the registry holds .*--max-steering-vectors 1"):
        read_vector_sources([f"a={control}", f"b={control}"], HIDDEN, 1)


def test_bad_steered_model_entries_are_refused_naming_the_entry(tmp_path):
    from nnterp_vllm.serve.steered_models import read_steered_model_sources
    from nnterp_vllm.serve.steering_field import read_steering

    reader = functools.partial(read_steering, num_layers=3, hidden_size=HIDDEN, max_specs=12)

    (tmp_path / "dict.yaml").write_text("kind: add")
    (tmp_path / "wrong.json").write_text('[{"vector": "v", "layers": 1, "factor": "big"}]')
    vectors = {"v": torch.ones(HIDDEN), "per_layer": {0: torch.ones(HIDDEN)}}
    cases = [
        (["formal"], "the form is NAME=RECIPE"),
        (["formal="], "the form is NAME=RECIPE"),
        (["formal=v@1", "formal=v@2"], "two entries name 'formal'"),
        (["formal=v"], r"a recipe is VECTOR@LAYER\[:FACTOR\]"),
        (["formal=v@1:big"], "the factor is a number, got 'big'"),
        (["formal=v@4"], r"\(steering\[0\]\.layers\): .*layer\(s\) \[4\] do not exist"),
        (["formal=w@1"], r"\(steering\): .*\['w'\], which no vector is registered as"),
        (["formal=per_layer@1"], r"\(steering\[0\]\.layers\): .*'per_layer' carries layers \[0\], not \[1\]"),
        ([f"formal={tmp_path / 'missing.yaml'}"], "no recipe file"),
        ([f"formal={tmp_path / 'dict.yaml'}"], "holds dict; a recipe file holds a list"),
        ([f"formal={tmp_path / 'wrong.json'}"], r"\(steering\[0\]\.factor\)"),
        (["tiny=v@1"], "the base model's name"),
    ]
    for entries, message in cases:
        with pytest.raises(ValueError, match=f"--steered-model {re.escape(entries[-1])}.*{message}"):
            read_steered_model_sources(entries, reader, vectors, {}, [MODEL])
    read = read_steered_model_sources(["a=v@0-2:0.5+per_layer@0"], reader, vectors, {}, [MODEL])
    assert read["a"].steering == [
        {"kind": "add", "vector": "v", "layers": [0, 1, 2], "factor": 0.5},
        {"kind": "add", "vector": "per_layer", "layers": 0, "factor": 1.0},
    ]


@pytest.mark.parametrize(
    "entry, message",
    [
        ("vectors", "vector 'short'"),
        ("models", "--steered-model formal=nowhere@1 (steering): 'formal' steers with ['nowhere'], which no vector"),
    ],
)
def test_the_command_line_refuses_a_bad_vector_file_or_recipe_in_one_line_before_the_engine_starts(
    tmp_path, entry, message
):
    path = tmp_path / "vectors.safetensors"
    save_file({"short": torch.zeros(7)} if entry == "vectors" else {"v": torch.zeros(HIDDEN)}, str(path))
    command = [SERVE, "serve", str(tiny.checkpoint("llama")), "--steering-vectors", str(path)]
    if entry == "models":
        command += ["--steered-model", "formal=nowhere@1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("nnterp-vllm: error:")]
    assert message in line
    assert "EngineCore" not in result.stderr  # refused before any engine process
