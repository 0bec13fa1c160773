"""``nnterp-vllm serve`` over loopback: real clients (``openai``, ``httpx``) against the real server.

One server process (the ``nnterp-vllm`` console script, tiny llama) serves every test of the module;
what each steered request must answer comes first, from `SteeredVLLM.generate` in this process, shut
down before the server starts. The last tests stop that server with SIGTERM (it drains, exits 0 and
leaves no process or shared-memory file behind) and then run the 2-replica Ray Serve deployment.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import psutil
import pytest
import tiny
import torch
from safetensors.torch import save_file
from vllm import SamplingParams

from nnterp_vllm import SteeredVLLM, Steering

SERVE = str(Path(sys.executable).with_name("nnterp-vllm"))
MODEL = "tiny"
STEPS = 12
#: Engine arguments of the server and of the in-process engine that computes what it must answer.
ENGINE = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": 32 * 2**20}
GREEDY = {"max_tokens": STEPS, "temperature": 0.0}
EXTRA = {"ignore_eos": True, "return_token_ids": True}
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
MESSAGES = [{"role": "user", "content": "Name a colour."}]
PROMPT = "The quick brown fox"
CONCURRENT = 64
STARTUP_SECONDS = 300


def vectors(hidden_size: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(17)
    return {name: torch.randn(hidden_size, generator=generator) * 4 for name in ("inline", "preloaded", "posted")}


def as_json(specs: list[Steering], names: dict[int, str] | None = None) -> list[dict]:
    """Specs as a request's ``steering`` field; ``names`` sends spec ``i``'s vector by its registered name."""
    names = names or {}
    return [
        {
            "layers": spec.layers,
            "vector": names.get(i) or spec.vector.tolist(),
            "factor": spec.factor,
            "positions": spec.positions,
        }
        for i, spec in enumerate(specs)
    ]


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


class Server:
    """``nnterp-vllm serve`` in its own session, on a free loopback port."""

    def __init__(self, arguments: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
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
    """What every case must answer (SteeredVLLM, shut down), then the server, with a preloaded vector file."""
    path = tiny.checkpoint("llama")
    tokenizer = tiny.tokenizer()
    llm = SteeredVLLM(path, **ENGINE)
    hidden_size = llm.hidden_size
    found = vectors(hidden_size)
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
    }
    concurrent = concurrent_cases(found)
    try:
        prompts = [prompt for prompt, _ in single.values()] + [prompt for prompt, _, _ in concurrent]
        steering = [specs for _, specs in single.values()] + [specs for _, specs, _ in concurrent]
        outputs = llm.generate(prompts, SamplingParams(**GREEDY, ignore_eos=True), steering)
    finally:
        llm.shutdown()
    tokens = [list(output.outputs[0].token_ids) for output in outputs]
    directory = tmp_path_factory.mktemp("serve")
    vector_file = directory / "vectors.safetensors"
    save_file({"preloaded": found["preloaded"]}, str(vector_file))
    (directory / "chat.jinja").write_text(CHAT_TEMPLATE)
    arguments = [str(path), "--served-model-name", MODEL, "--steering-vectors", str(vector_file)]
    arguments += ["--chat-template", str(directory / "chat.jinja")]
    arguments += [f"--{key.replace('_', '-')}={value}" for key, value in ENGINE.items()]
    server = Server(arguments, directory / "server.log")
    try:
        server.wait_ready()
        yield SimpleNamespace(
            server=server,
            url=server.url,
            arguments=arguments,
            directory=directory,
            vectors=found,
            steered=steered,
            chat_ids=chat_ids,
            expected=dict(zip(single, tokens)),
            concurrent=list(zip(concurrent, tokens[len(single) :])),
        )
    finally:
        server.stop()


def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)


def completion_tokens(served, steering: list[dict] | None, stream: bool) -> list[int]:
    body = {**EXTRA, **({"steering": steering} if steering is not None else {})}
    response = client(served).completions.create(model=MODEL, prompt=PROMPT, stream=stream, extra_body=body, **GREEDY)
    chunks = list(response) if stream else [response]
    return [token for chunk in chunks for choice in chunk.choices for token in choice.token_ids or []]


def chat_tokens(served, steering: list[dict] | None, stream: bool) -> tuple[list[int], list[int]]:
    """The generated tokens and the prompt's tokens as the server rendered them."""
    body = {**EXTRA, **({"steering": steering} if steering is not None else {})}
    response = client(served).chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=stream, extra_body=body, **GREEDY
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


def test_models_health_and_usage_are_vllms(served):
    assert [model.id for model in client(served).models.list().data] == [MODEL]
    response = client(served).completions.create(model=MODEL, prompt=PROMPT, extra_body=EXTRA, **GREEDY)
    assert response.usage.prompt_tokens == len(PROMPT) and response.usage.completion_tokens == STEPS


def concurrent_tokens(url: str, cases: list[tuple[str, list[Steering], dict[int, str]]]) -> list[list[int]]:
    """Each case's generated tokens, all sent at once by one asyncio ``openai`` client."""

    async def all_requests():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as aclient:

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
    return httpx.post(served.url + path, content=content, headers={"content-type": "application/json"}, timeout=60)


def spec(**fields) -> dict:
    return {"layers": 1, "vector": [0.5] * tiny.SIZES["hidden_size"], **fields}


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
    ([spec(scale=2.0)], "steering[0].scale", "unknown field 'scale'"),
    ([{"layers": 1}], "steering[0].vector", "'vector' is required"),
    (["layer 1"], "steering[0]", "a steering spec is an object"),
    (spec(), "steering", "steering must be a list of specs"),
    (
        [spec(positions=p) for p in ("prompt", "generated", [0])],
        "steering",
        "act on 3 distinct combinations",
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
    listed = httpx.get(served.url + vectors_url).json()
    assert listed["data"] == [{"object": "steering.vector", "name": "preloaded", "size": HIDDEN}]  # --steering-vectors
    posted = served.vectors["posted"].tolist()
    assert post(served, vectors_url, {"name": "posted", "vector": posted}).status_code == 201
    assert post(served, vectors_url, {"name": "posted", "vector": posted}).status_code == 200  # the same again
    conflict = post(served, vectors_url, {"name": "posted", "vector": [0.0] * HIDDEN})
    assert conflict.status_code == 409 and conflict.json()["error"]["param"] == "name"
    names = [entry["name"] for entry in httpx.get(served.url + vectors_url).json()["data"]]
    assert names == ["posted", "preloaded"]
    steering = [{"layers": 0, "vector": "posted", "factor": 1.5}]
    assert completion_tokens(served, steering, stream=True) == served.expected["posted"]
    assert httpx.delete(served.url + vectors_url + "/posted").json()["deleted"] is True
    missing = httpx.delete(served.url + vectors_url + "/posted")
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
    assert [e["name"] for e in httpx.get(served.url + "/v1/steering/vectors").json()["data"]] == ["preloaded"]


def metrics(served) -> dict[str, float]:
    """vLLM's Prometheus counters and gauges, summed over labels."""
    found: dict[str, float] = {}
    for line in httpx.get(served.url + "/metrics").text.splitlines():
        if line.startswith("vllm:"):
            name, value = line.rsplit(" ", 1)
            found[name.split("{")[0]] = found.get(name.split("{")[0], 0.0) + float(value)
    return found


def test_a_client_that_disconnects_mid_stream_frees_its_request(served):
    tokens = 256 - len(PROMPT) - 1
    before = metrics(served)["vllm:generation_tokens_total"]
    body = {"model": MODEL, "prompt": PROMPT, "stream": True, "max_tokens": tokens, "ignore_eos": True}
    body["steering"] = as_json(served.steered)
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60) as response:
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
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=120) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        served.server.terminate()
        rest = [line for line in lines if line.startswith("data: ")]
    chunks = [json.loads(line[6:]) for line in [first, *rest] if line != "data: [DONE]"]
    assert rest[-1] == "data: [DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length"  # drained
    assert served.server.stop() == 0
    served.server.assert_left_nothing()


def test_two_replicas_on_ray_serve_answer_steered_requests(served):
    """``--replicas 2`` on a local Ray cluster the server starts (and stops on SIGTERM)."""
    server = Server(
        served.arguments + ["--replicas", "2"],
        served.directory / "replicas.log",
        env={"RAY_AUTH_MODE": "disabled", "RAY_DEDUP_LOGS": "0"},
    )
    try:
        server.wait_ready()
        replicas = SimpleNamespace(**{**vars(served), "url": server.url})
        vectors_url = "/v1/steering/vectors"
        assert post(replicas, vectors_url, {"name": "posted", "vector": served.vectors["posted"].tolist()}).is_success

        cases = [case for case, _ in served.concurrent[:16]]
        cases += [(PROMPT, [Steering(0, served.vectors["posted"], factor=1.5)], {0: "posted"})] * 4
        results = concurrent_tokens(server.url, cases)
        assert results == [expected for _, expected in served.concurrent[:16]] + [served.expected["posted"]] * 4
    finally:
        status = server.stop(timeout=180)
    assert status == 0, server.log.read_text()[-5000:]
    server.assert_left_nothing()


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
    ],
)
def test_what_the_server_cannot_serve_is_refused_as_the_command_line_is_read(flags, message):
    from nnterp_vllm.serve import parse

    with pytest.raises(ValueError, match=message):
        parse([str(tiny.checkpoint("llama")), *flags])


@pytest.mark.parametrize(
    "tensors, message",
    [
        ({"short": torch.zeros(7)}, r"vector 'short'.*\[hidden_size\] = \[128\]"),
        ({"nan": torch.full((HIDDEN,), float("nan"))}, "NaN or inf"),
        ({"rows": torch.zeros(2, HIDDEN)}, r"\[hidden_size\] = \[128\]"),
        ({"a b": torch.zeros(HIDDEN)}, "a vector's name is 1 to 128 letters"),
        (None, "cannot read it as a safetensors file"),
    ],
)
def test_a_bad_steering_vectors_file_is_refused_naming_the_entry(tmp_path, tensors, message):
    from nnterp_vllm.serve.fields import read_vectors_file

    path = tmp_path / "vectors.safetensors"
    if tensors is None:
        path.write_text("not safetensors")
    else:
        save_file(tensors, str(path))
    with pytest.raises(ValueError, match=f"--steering-vectors {path}: .*{message}"):
        read_vectors_file(path, HIDDEN)


def test_the_command_line_refuses_a_bad_vector_file_in_one_line_before_the_engine_starts(tmp_path):
    path = tmp_path / "vectors.safetensors"
    save_file({"short": torch.zeros(7)}, str(path))
    command = [SERVE, "serve", str(tiny.checkpoint("llama")), "--steering-vectors", str(path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("nnterp-vllm: error:")]
    assert "vector 'short'" in line and "[hidden_size] = [128]" in line
    assert "EngineCore" not in result.stderr  # refused before any engine process
