// The playground page: one prompt completed twice at temperature 0, unsteered and steered, both streamed from
// /v1/completions. Steered by a vector (or a steered model whose recipe adds one), both are read by a probe whose
// weight is the vector's unit direction at its block, so each generated token shows the projection of that block's
// output (before the vector is added) at the step that chose it.
"use strict";

const PROBE = "projection";
const $ = (id) => document.getElementById(id);
const state = { model: null, layers: 0, saes: [], vectors: [], models: [], values: new Map() };

async function fetched(path, options) {
  const response = await fetch(path, options);
  if (!response.ok) {
    let message = `${response.status} ${response.statusText}`;
    try {
      const body = await response.json();
      message = body.error?.message ?? body.detail ?? message;
    } catch (_) { /* not JSON: the status says it */ }
    throw new Error(`${path}: ${message}`);
  }
  return response;
}

async function json(path) {
  return (await fetched(path)).json();
}

function options(select, entries) {
  select.replaceChildren(...entries.map(([value, label]) => new Option(label, value)));
}

function kind() {
  return document.querySelector("input[name=kind]:checked").value;
}

function showKind() {
  for (const fieldset of document.querySelectorAll("fieldset[data-kind]")) {
    fieldset.hidden = fieldset.dataset.kind !== kind();
  }
}

function showBlocks() {
  const entry = state.vectors.find((vector) => vector.name === $("vector").value);
  const blocks = entry?.layers ?? [...Array(state.layers).keys()];
  options($("block"), blocks.map((block) => [block, `block ${block}`]));
}

function showFeatureRange() {
  const sae = state.saes.find((entry) => entry.name === $("sae").value);
  $("feature").max = sae ? sae.features - 1 : 0;
}

function showRecipe() {
  const entry = state.models.find((model) => model.name === $("steered-model").value);
  $("recipe").textContent = entry ? `Recipe: ${JSON.stringify(entry.steering)}` : "";
}

async function load() {
  const [models, model, vectors, steered] = await Promise.all([
    json("/v1/models"), json("/playground/model.json"), json("/v1/steering/vectors"), json("/v1/steering/models"),
  ]);
  const base = models.data.find((entry) => !entry.parent);
  state.models = steered.data;
  options($("steered-model"), steered.data.map((entry) => [entry.name, entry.name]));
  state.model = base.id;
  state.layers = model.num_layers;
  state.saes = model.saes;
  state.vectors = vectors.data;
  $("model-name").textContent = `${base.id} (${model.num_layers} blocks, width ${model.hidden_size})`;
  options($("vector"), vectors.data.map((entry) => [entry.name, entry.name]));
  options($("sae"), model.saes.map((entry) => [entry.name, `${entry.name} (block ${entry.layer}, ${entry.features} features)`]));
  const offers = [["vector", vectors.data.length], ["sae", model.saes.length], ["model", steered.data.length]];
  for (const [value, offered] of offers) {
    const radio = document.querySelector(`input[name=kind][value=${value}]`);
    radio.disabled = !offered;
    if (!offered) radio.parentElement.append(" (none on this server)");
  }
  const first = document.querySelector("input[name=kind]:not(:disabled)");
  if (!first) {
    throw new Error("This server holds no vector and no SAE to steer with: register a vector (POST " +
      "/v1/steering/vectors, or --steering-vectors) or start it with --sae NAME=DIR.");
  }
  first.checked = true;
  showKind();
  showBlocks();
  showFeatureRange();
  showRecipe();
}

async function direction(name, block) {
  if (!state.values.has(name)) {
    state.values.set(name, await json(`/v1/steering/vectors/${encodeURIComponent(name)}`));
  }
  const entry = state.values.get(name);
  const vector = entry.vector ?? entry.layers[String(block)];
  const norm = Math.sqrt(vector.reduce((sum, x) => sum + x * x, 0));
  return norm > 0 ? vector.map((x) => x / norm) : null;
}

// The probe reading the projection on a registered vector's unit direction at a block (null: a zero vector).
async function projection(name, block) {
  const weight = await direction(name, block);
  return weight ? { [PROBE]: { weight, bias: 0, layer: block } } : null;
}

// What the steered request adds to the unsteered one's body, the probe both read (null: none) and its block.
async function steering() {
  const which = kind();
  if (which === "sae") {
    const spec = { kind: "clamp", sae: $("sae").value, feature: Number($("feature").value), value: Number($("clamp").value) };
    return { added: { steering: [spec] }, probes: null };
  }
  if (which === "model") {
    const entry = state.models.find((model) => model.name === $("steered-model").value);
    // The strip reads the first registered vector the recipe adds, at its first block.
    const added = entry.steering.find((spec) => (spec.kind ?? "add") === "add" && typeof spec.vector === "string");
    const block = added ? [added.layers].flat()[0] : null;
    const probes = added && block !== undefined ? await projection(added.vector, block) : null;
    return { added: { model: entry.name }, probes, block };
  }
  const name = $("vector").value;
  const block = Number($("block").value);
  const added = { steering: [{ layers: block, vector: name, factor: Number($("factor").value) }] };
  return { added, probes: await projection(name, block), block };
}

// Streams one completion, calling onChoice with each chunk's choice.
async function stream(body, onChoice) {
  const response = await fetched("/v1/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
  });
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        chunk.choices.forEach(onChoice);
      }
    }
  }
}

// One completion as it streams into its <pre> (its token ids in data-token-ids), with each token's text and probe.
function completion(name) {
  const target = $(`${name}-text`);
  const found = { name, ids: [], texts: [], probes: null };
  target.textContent = "";
  target.dataset.tokenIds = "[]";
  $(`${name}-strip-figure`).hidden = true;
  return {
    found,
    onChoice(choice) {
      target.textContent += choice.text;
      const ids = choice.token_ids ?? [];
      const texts = choice.logprobs?.tokens ?? [];
      ids.forEach((id, i) => {
        found.ids.push(id);
        found.texts.push(texts[i] ?? "");
      });
      target.dataset.tokenIds = JSON.stringify(found.ids);
      if (choice.probes) found.probes = choice.probes[PROBE];
    },
  };
}

// At most 0.6 opaque, so a token's text stays readable on its colour.
function colour(value, largest) {
  const alpha = largest > 0 ? 0.6 * Math.min(Math.abs(value) / largest, 1) : 0;
  return value >= 0 ? `rgba(214, 39, 40, ${alpha})` : `rgba(31, 119, 180, ${alpha})`;
}

// Scores come for every token fed through the model (the prompt's, then each generated one but the last): the
// last as many as were generated are those of the steps that chose each generated token.
function projections(found) {
  return found.probes.slice(-found.ids.length).map((score) => (Array.isArray(score) ? score[0] : score));
}

// Both completions' strips, on one colour scale.
function showStrips(completions, block) {
  const values = completions.map(projections);
  const largest = Math.max(...values.flat().map(Math.abs));
  completions.forEach((found, k) => {
    $(`${found.name}-strip`).replaceChildren(...found.texts.map((text, i) => {
      const value = values[k][i];
      const item = document.createElement("li");
      item.dataset.value = String(value);
      item.dataset.tokenId = String(found.ids[i]);
      item.style.backgroundColor = colour(value, largest);
      item.textContent = text;
      item.title = `token ${found.ids[i]}: projection ${value.toFixed(3)}`;
      item.setAttribute("aria-label", `${JSON.stringify(text)}: ${value.toFixed(3)}`);
      return item;
    }));
    $(`${found.name}-strip-caption`).textContent = found.name === "steered"
      ? `Each generated token coloured by the projection of block ${block}'s output (before the vector is added) ` +
        "on the vector at unit length, at the step that chose it: red positive, blue negative, paler nearer 0."
      : "The same projection in the unsteered run, on the same scale.";
    $(`${found.name}-strip-figure`).hidden = false;
  });
}

async function run(event) {
  event.preventDefault();
  $("error").textContent = "";
  $("run").disabled = true;
  $("status").textContent = "Running…";
  try {
    const body = {
      model: state.model,
      prompt: $("prompt").value,
      max_tokens: Number($("max-tokens").value),
      temperature: 0,
      stream: true,
      return_token_ids: true,
      logprobs: 0,
    };
    const { added, probes, block } = await steering();
    const plain = completion("plain");
    const steered = completion("steered");
    const read = probes ? { probes } : {};
    await Promise.all([
      stream({ ...body, ...read }, plain.onChoice),
      stream({ ...body, ...added, ...read }, steered.onChoice),
    ]);
    if (probes) showStrips([plain.found, steered.found], block);
    $("status").textContent = "Done.";
  } catch (error) {
    $("error").textContent = error.message;
    $("status").textContent = "Failed.";
  } finally {
    $("run").disabled = false;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  for (const [slider, shown] of [["factor", "factor-value"], ["clamp", "clamp-value"]]) {
    $(slider).addEventListener("input", () => { $(shown).value = $(slider).value; });
  }
  for (const radio of document.querySelectorAll("input[name=kind]")) radio.addEventListener("change", showKind);
  $("vector").addEventListener("change", showBlocks);
  $("sae").addEventListener("change", showFeatureRange);
  $("steered-model").addEventListener("change", showRecipe);
  $("run-form").addEventListener("submit", run);
  load().catch((error) => {
    $("error").textContent = error.message;
    $("run").disabled = true;
  });
});
