"""The playground (``GET /playground``) in a real browser: Debian's chromium, driven by selenium, against a real
``nnterp-vllm serve`` process (tiny llama, a registered vector, an SAE, ``--api-key``) on loopback.

What the page shows (both completions, the strip's per-token projections) is checked against the server's own
answers to the same requests sent with httpx; the sign-in and its refusals over plain HTTP.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import httpx
import pytest
import reference
import tiny
import torch
from safetensors.torch import load_file, save_file
from test_serve import Server

from nnterp_vllm.serve.traces import TRACE_PATH

HIDDEN = tiny.SIZES["hidden_size"]
MODEL = "tiny"
KEY = "playground-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
#: The engine is built eagerly: the page's subject is what the API answers, which the compiled engine's own tests
#: (tests/test_serve.py) hold equal to transformers; compiling it here would add a minute on a fresh machine.
ENGINE = ["--dtype=float32", "--max-model-len=256", "--kv-cache-memory-bytes=33554432", "--enforce-eager"]
VECTOR = "calm"
SAE = "res1"
PROMPT = "The quick brown fox"
#: The vector's token: the vector is its unembedding row, so steering makes the completion show it.
SHOWN = "o"
BLOCK = 1
STEPS = 10
#: The sliders move in steps of 0.5 from 0: this many presses of the right arrow key.
PRESSES = 8
STRENGTH = PRESSES * 0.5
FEATURE = 4
#: A steered model: the vector at the block, at the strength the slider is moved to.
STEERED = "calmer"
INSTALL = "apt-get install -y --no-install-recommends chromium chromium-driver"
BROWSER, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
SECONDS = 120

needs_browser = pytest.mark.skipif(
    not (BROWSER and DRIVER),
    reason=f"the browser tests need Debian's chromium and chromedriver (missing: "
    f"{', '.join(name for name, path in (('chromium', BROWSER), ('chromedriver', DRIVER)) if not path)}); "
    f"install them with `{INSTALL}` (make install does, as root)",
)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The server, with the vector ``calm`` preloaded (`SHOWN`'s unembedding row, scaled) and the SAE ``res1``
    (block 1) held."""
    directory = tmp_path_factory.mktemp("playground")
    reference.saelens_sae(directory / SAE, "standard", f"blocks.{BLOCK}.hook_resid_post", HIDDEN, seed=5)
    checkpoint = tiny.checkpoint("llama")
    unembedding = load_file(str(checkpoint / "model.safetensors"))["lm_head.weight"]
    vector = unembedding[tiny.tokenizer().convert_tokens_to_ids(SHOWN)] * 20
    save_file({VECTOR: vector}, str(directory / "vectors.safetensors"))
    arguments = [str(checkpoint), "--served-model-name", MODEL, "--api-key", KEY, *ENGINE]
    arguments += ["--steering-vectors", str(directory / "vectors.safetensors"), "--sae", f"{SAE}={directory / SAE}"]
    arguments += ["--steered-model", f"{STEERED}={VECTOR}@{BLOCK}:{STRENGTH}"]
    server = Server(arguments, directory / "server.log")
    try:
        server.wait_ready()
        server.vector = vector
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser(served, tmp_path_factory):
    """Headless chromium, signed in to the playground with the server's key. Its temporary files (the profile's
    lock socket, which chromium leaves behind) go in a directory of its own, removed after."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = BROWSER
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1100"):
        options.add_argument(argument)
    temporary = tmp_path_factory.mktemp("chromium")
    service = Service(executable_path=DRIVER, env={**os.environ, "TMPDIR": str(temporary)})
    driver = webdriver.Chrome(options=options, service=service)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(temporary, ignore_errors=True)


def sign_in(driver, key: str) -> None:
    from selenium.webdriver.common.by import By

    field = driver.find_element(By.ID, "key")
    field.clear()
    field.send_keys(key)
    field.submit()


def completion(served, steering: dict) -> dict:
    """The server's whole (unstreamed) answer to the request the page sends, with ``steering`` added."""
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": STEPS,
        "temperature": 0,
        "return_token_ids": True,
        "logprobs": 0,
        **steering,
    }
    response = httpx.post(served.url + "/v1/completions", json=body, headers=AUTH, timeout=SECONDS)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def unit(values: list[float]) -> list[float]:
    """``values`` at unit length, computed as the page computes it (a sum in order, in float64)."""
    norm = math.sqrt(sum(x * x for x in values))
    return [x / norm for x in values]


def run_page(driver, served, choose) -> dict:
    """Open the playground signed in, type the prompt and the tokens, let ``choose`` pick what steers, run, and
    read what the page shows of each completion: its text, its tokens and its strip's tokens and values."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(served.url + "/playground")
    WebDriverWait(driver, SECONDS).until(lambda d: d.find_element(By.ID, "model-name").text.startswith(MODEL))
    prompt = driver.find_element(By.ID, "prompt")
    prompt.clear()
    prompt.send_keys(PROMPT)
    steps = driver.find_element(By.ID, "max-tokens")
    steps.clear()
    steps.send_keys(str(STEPS))
    choose(driver)
    driver.find_element(By.ID, "run").click()
    WebDriverWait(driver, SECONDS).until(expected_conditions.text_to_be_present_in_element((By.ID, "status"), "Done."))
    assert driver.find_element(By.ID, "error").text == ""
    shown = {}
    for name in ("plain", "steered"):
        text = driver.find_element(By.ID, f"{name}-text")
        strip = driver.find_elements(By.CSS_SELECTOR, f"#{name}-strip li")
        shown[name] = {
            "text": text.get_attribute("textContent"),
            "token_ids": json.loads(text.get_attribute("data-token-ids")),
            "strip": driver.find_element(By.ID, f"{name}-strip-figure").is_displayed(),
            "tokens": [item.get_attribute("textContent") for item in strip],
            "values": [float(item.get_attribute("data-value")) for item in strip],
        }
    return shown


def slide(driver, slider_id: str, output_id: str) -> None:
    """Move a slider `PRESSES` steps right with the keyboard; its shown value must follow."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver.find_element(By.ID, slider_id).send_keys(*[Keys.ARROW_RIGHT] * PRESSES)
    assert float(driver.find_element(By.ID, output_id).text) == STRENGTH


@needs_browser
def test_a_vector_steers_the_page_as_the_api_answers_and_the_strip_shows_its_projections(served, browser, tmp_path):
    """Signed in with the key (a wrong one refused in the page), the vector at block 1 moved to strength 4: both
    streamed completions are the server's whole answers to the same requests, and each one's strip holds each
    generated token's projection on the vector's unit direction, as a probe of that weight at that block reads it."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    browser.get(served.url + "/playground")
    sign_in(browser, "not-the-key")
    assert "not a key this server was started with" in browser.find_element(By.ID, "refused").text
    sign_in(browser, KEY)

    def choose(driver) -> None:
        Select(driver.find_element(By.ID, "vector")).select_by_value(VECTOR)
        Select(driver.find_element(By.ID, "block")).select_by_value(str(BLOCK))
        slide(driver, "factor", "factor-value")

    shown = run_page(browser, served, choose)
    browser.save_screenshot(str(tmp_path / "playground.png"))
    probes = {"probes": {"projection": {"weight": unit(served.vector.tolist()), "bias": 0, "layer": BLOCK}}}
    answers = {
        "plain": completion(served, probes),
        "steered": completion(
            served, {"steering": [{"layers": BLOCK, "vector": VECTOR, "factor": STRENGTH}], **probes}
        ),
    }
    for name, answer in answers.items():
        page = shown[name]
        assert (page["text"], page["token_ids"]) == (answer["text"], answer["token_ids"]), name
        assert page["strip"] and page["tokens"] == answer["logprobs"]["tokens"], name
        scores = answer["probes"]["projection"]
        assert len(scores) == len(answer["prompt_token_ids"]) + STEPS - 1  # every token fed through the model
        torch.testing.assert_close(torch.tensor(page["values"]), torch.tensor(scores[-STEPS:]), rtol=1e-4, atol=1e-4)
    assert SHOWN in shown["steered"]["text"] and SHOWN not in shown["plain"]["text"]  # the vector steered


@needs_browser
def test_an_sae_feature_clamped_in_the_page_answers_as_the_api(served, browser):
    """The SAE choice: feature 4 of ``res1`` clamped to 4 steers the page's completion as the same clamp sent to
    the API does (and no strip: a feature has no vector of the page's)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    def choose(driver) -> None:
        driver.find_element(By.CSS_SELECTOR, "input[name=kind][value=sae]").click()
        Select(driver.find_element(By.ID, "sae")).select_by_value(SAE)
        feature = driver.find_element(By.ID, "feature")
        feature.clear()
        feature.send_keys(str(FEATURE))
        slide(driver, "clamp", "clamp-value")

    shown = run_page(browser, served, choose)
    answers = {
        "plain": completion(served, {}),
        "steered": completion(
            served, {"steering": [{"kind": "clamp", "sae": SAE, "feature": FEATURE, "value": STRENGTH}]}
        ),
    }
    for name, answer in answers.items():
        page = shown[name]
        assert (page["text"], page["token_ids"], page["strip"]) == (answer["text"], answer["token_ids"], False)
    assert answers["steered"]["token_ids"] != answers["plain"]["token_ids"]  # the clamp steered


@needs_browser
def test_a_steered_model_chosen_in_the_page_answers_as_the_api_and_its_recipes_vector_is_projected(served, browser):
    """The steered-model choice: ``calmer`` (the vector at block 1, strength 4) completes as the API answers a request
    for that model, and the strip reads the projection on its recipe's vector at its block."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    def choose(driver) -> None:
        driver.find_element(By.CSS_SELECTOR, "input[name=kind][value=model]").click()
        Select(driver.find_element(By.ID, "steered-model")).select_by_value(STEERED)
        assert VECTOR in driver.find_element(By.ID, "recipe").text

    shown = run_page(browser, served, choose)
    probes = {"probes": {"projection": {"weight": unit(served.vector.tolist()), "bias": 0, "layer": BLOCK}}}
    answers = {"plain": completion(served, probes), "steered": completion(served, {"model": STEERED, **probes})}
    by_hand = completion(served, {"steering": [{"layers": BLOCK, "vector": VECTOR, "factor": STRENGTH}]})
    assert answers["steered"]["token_ids"] == by_hand["token_ids"] != answers["plain"]["token_ids"]
    for name, answer in answers.items():
        page = shown[name]
        assert (page["text"], page["token_ids"]) == (answer["text"], answer["token_ids"]), name
        scores = answer["probes"]["projection"][-STEPS:]
        torch.testing.assert_close(torch.tensor(page["values"]), torch.tensor(scores), rtol=1e-4, atol=1e-4)


def test_a_registered_vector_reads_back_and_a_missing_one_is_a_404_naming_it(served):
    response = httpx.get(f"{served.url}/v1/steering/vectors/{VECTOR}", headers=AUTH)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert (answer["name"], answer["size"]) == (VECTOR, HIDDEN)
    assert torch.equal(torch.tensor(answer["vector"]), served.vector)
    missing = httpx.get(f"{served.url}/v1/steering/vectors/absent", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "name"
    assert "no vector is registered as 'absent'" in missing.json()["error"]["message"]


def test_the_page_asks_for_the_key_and_its_cookie_opens_only_same_origin_requests(served):
    """Without a key the page's paths answer the sign-in form (401) and every other path 401 as before; a wrong key
    is refused, a cross-site form 403; the right key comes back as an HttpOnly SameSite=Strict cookie that opens
    the page, its files and the API, but not to a request from another origin, nor the routes taking code; the key
    is never logged."""
    logged = served.log.read_text().count(KEY)
    for path in ("/", "/playground"):
        response = httpx.get(served.url + path)
        assert response.status_code == 401 and 'name="key"' in response.text, path
    for path in ("/playground/static/playground.js", "/playground/model.json", f"/v1/steering/vectors/{VECTOR}"):
        assert httpx.get(served.url + path).status_code == 401, path
    wrong = httpx.post(served.url + "/playground", data={"key": "wrong"})
    assert wrong.status_code == 401 and "not a key this server was started with (--api-key)" in wrong.text
    assert "set-cookie" not in wrong.headers
    crossed = httpx.post(served.url + "/playground", data={"key": KEY}, headers={"Origin": "http://elsewhere.test"})
    assert crossed.status_code == 403 and "set-cookie" not in crossed.headers
    signed = httpx.post(served.url + "/playground", data={"key": KEY})
    assert signed.status_code == 303 and signed.headers["location"] == "/playground"
    cookie = signed.headers["set-cookie"]
    assert all(part in cookie for part in ("HttpOnly", "SameSite=strict", "Path=/")), cookie
    with httpx.Client(base_url=served.url, cookies=signed.cookies) as browser:
        assert browser.get("/").headers["location"] == "/playground"
        assert browser.get("/playground").status_code == 200
        script = browser.get("/playground/static/playground.js")
        assert script.status_code == 200 and "javascript" in script.headers["content-type"]
        assert browser.get("/playground/model.json").json()["saes"] == [{"name": SAE, "layer": BLOCK, "features": 64}]
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
        assert browser.post("/v1/completions", json=body).status_code == 200
        own = {"Origin": served.url}
        assert browser.post("/v1/completions", json=body, headers=own).status_code == 200
        other = browser.post("/v1/completions", json=body, headers={"Origin": "http://elsewhere.test"})
        assert other.status_code == 401
        assert browser.post(TRACE_PATH, content=b"code").status_code == 401  # code is sent with the key itself
    forged = httpx.get(served.url + "/playground/model.json", cookies={"nnterp_vllm_key": "wrong"})
    assert forged.status_code == 401
    assert served.log.read_text().count(KEY) == logged
