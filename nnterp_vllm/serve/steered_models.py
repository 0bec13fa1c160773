"""Steered models: names a client asks for as ``model``, each served as the base model steered by its recipe.

A client that cannot send ``steering`` (an evaluation harness, a chat client building its own bodies) changes
one string instead: ``"model": "formal"`` on any route that serves ``steering`` is the base model with the
recipe registered as ``formal`` applied, before any ``steering`` the request carries itself. Names are
registered with ``--steered-model NAME=RECIPE`` at start (`read_steered_model_sources`) or ``POST
/v1/steering/models`` at run time (`read_model_registration`); both check the recipe as a request's
``steering`` is checked, against the model and the vectors and SAEs the server holds. ``/v1/models`` lists each
name with the base model as its ``parent`` (`SteeredModelCards`); the intake swaps the name for the base model
before vLLM reads the body (`SteeredModelNames`) and names it again in the response.

A recipe is a list of specs in the server's wire format, or one of these forms:

- a ``.json``, ``.yaml`` or ``.yml`` file holding that list (or ``{"steering": [...]}``);
- ``VECTOR@LAYERS[:FACTOR]``, several joined by ``+``: a registered vector added at a block (``formal@10``), or
  at each block of an inclusive range (``formal@8-12:2.5``), times the factor (1 when left out).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping, Sequence
from http import HTTPStatus
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from .errors import InvalidField, error_json, naming, refusal, registration_answer
from .intake import decode_json
from .registry import Vector
from .steering_field import named_vectors, with_vectors
from .vector_registration import checked_name

MODELS_PATH = "/v1/steering/models"
#: Files a recipe may be read from, by suffix.
RECIPE_FILES = (".json", ".yaml", ".yml")
#: One term of a recipe's short form.
SHORT_TERM = re.compile(r"(?P<vector>[^@]+)@(?P<first>\d+)(?:-(?P<last>\d+))?(?::(?P<factor>.+))?")
SHORT_RULE = (
    "VECTOR@LAYER[:FACTOR] or VECTOR@FIRST-LAST[:FACTOR] (a registered vector, a block or an inclusive range of "
    "blocks, a factor), several joined by '+', e.g. formal@10:4.0; or a .json/.yaml file of specs"
)


@dataclasses.dataclass(frozen=True)
class SteeredModel:
    """A steered name: its recipe as the wire format spells it (``steering``), and as `read_steering` read it."""

    name: str
    steering: list[Any]
    read: list[dict[str, Any]] = dataclasses.field(repr=False, compare=False)


def recipe_specs(recipe: str, files: bool = True) -> list[Any]:
    """A recipe (a file, or the short form) as wire specs; raises ``ValueError``. Without ``files`` (a client's
    registration) a file name is refused: the server reads no file a client names."""
    if recipe.endswith(RECIPE_FILES) or (files and Path(recipe).is_file()):
        if not files:
            raise ValueError("a registration sends its specs as 'steering', not a file's name")
        return _recipe_file(Path(recipe))
    specs = []
    for term in recipe.split("+"):
        match = SHORT_TERM.fullmatch(term.strip())
        if match is None:
            raise ValueError(f"a recipe is {SHORT_RULE}; {term!r} is none of these")
        first = int(match["first"])
        last = int(match["last"]) if match["last"] is not None else first
        if last < first:
            raise ValueError(f"{term!r}: the blocks {first}-{last} run backwards; write {last}-{first}")
        try:
            factor = float(match["factor"]) if match["factor"] is not None else 1.0
        except ValueError:
            raise ValueError(f"{term!r}: the factor is a number, got {match['factor']!r}") from None
        layers = first if first == last else list(range(first, last + 1))
        specs.append({"kind": "add", "vector": match["vector"], "layers": layers, "factor": factor})
    return specs


def _recipe_file(path: Path) -> list[Any]:
    if not path.is_file():
        raise ValueError(f"no recipe file {str(path)!r}; a recipe is {SHORT_RULE}")
    text = path.read_text()
    if path.suffix == ".json":
        content = json.loads(text)
    else:
        import yaml

        content = yaml.safe_load(text)
    if isinstance(content, dict) and set(content) == {"steering"}:
        content = content["steering"]
    if not isinstance(content, list):
        raise ValueError(f"{path} holds {type(content).__name__}; a recipe file holds a list of steering specs")
    return content


def steered_model(
    name: Any, steering: Any, read: Callable[[Any], list[dict[str, Any]]], base_names: Sequence[str]
) -> SteeredModel:
    """``name`` and its recipe's wire specs, read by ``read`` (the server's reader of a request's ``steering``:
    `steering_field.read_steering` with the model's sizes and the server's bounds); raises `InvalidField` naming the
    field (``name``, ``steering[i].<field>``)."""
    with naming("name"):
        checked_name(name)
    if name in base_names:
        raise InvalidField(f"{name!r} is the base model's name; choose another name for a steered model", "name")
    if not steering:
        raise InvalidField(f"{name!r}: a steered model's recipe holds at least one spec", "steering")
    return SteeredModel(name, steering, read(steering))


def check_recipe(model: SteeredModel, registered: Mapping[str, Vector], saes: Mapping[str, Any]) -> None:
    """Refuse a recipe naming a vector or SAE this server does not hold (`InvalidField`)."""
    missing = named_vectors(model.read) - set(registered)
    if missing:
        raise InvalidField(
            f"{model.name!r} steers with {sorted(missing)}, which no vector is registered as: register it first "
            "(POST /v1/steering/vectors or --steering-vectors), or give the vector inline",
            "steering",
        )
    with_vectors(model.read, registered, saes)


def read_steered_model_sources(
    entries: Sequence[str],
    read: Callable[[Any], list[dict[str, Any]]],
    vectors: Mapping[str, Vector],
    saes: Mapping[str, Any],
    base_names: Sequence[str],
) -> dict[str, SteeredModel]:
    """``--steered-model``'s ``NAME=RECIPE`` entries, read (``read``: as `steered_model`) and checked against the
    vectors and SAEs held; raises ``ValueError`` naming the bad one."""
    models: dict[str, SteeredModel] = {}
    for entry in entries:
        name, separator, recipe = entry.partition("=")
        try:
            if not separator or not recipe:
                raise ValueError(f"the form is NAME=RECIPE, a recipe being {SHORT_RULE}")
            if name in models:
                raise ValueError(f"two entries name {name!r}")
            model = steered_model(name, recipe_specs(recipe), read, base_names)
            check_recipe(model, vectors, saes)
        except InvalidField as error:
            where = f" ({error.param})" if error.param else ""
            raise ValueError(f"--steered-model {entry}{where}: {error}") from None
        except ValueError as error:
            raise ValueError(f"--steered-model {entry}: {error}") from None
        models[name] = model
    return models


def read_model_registration(
    body: bytes, read: Callable[[Any], list[dict[str, Any]]], base_names: Sequence[str]
) -> SteeredModel:
    """A ``POST /v1/steering/models`` body: ``{"name", "steering": [specs]}`` or ``{"name", "recipe": "<short
    form>"}``, its recipe read by ``read`` (as `steered_model`). Raises `InvalidField`; meant to run off the event
    loop."""
    try:
        parsed = decode_json(body)
    except ValueError as error:
        raise InvalidField(f"the body is not JSON: {error}", None) from None
    if not isinstance(parsed, dict):
        raise InvalidField(f"the body is an object {{'name', 'steering'}}, got {type(parsed).__name__}", None)
    for key in parsed:
        if key not in ("name", "steering", "recipe"):
            raise InvalidField(
                f"unknown field {key!r}; a steered model is registered with 'name' and 'steering' (or 'recipe')", key
            )
    if ("steering" in parsed) == ("recipe" in parsed):
        raise InvalidField("give the recipe as exactly one of 'steering' (a list of specs) or 'recipe'", "steering")
    steering = parsed.get("steering")
    if "recipe" in parsed:
        if not isinstance(parsed["recipe"], str):
            raise InvalidField(f"recipe: {SHORT_RULE}; got {type(parsed['recipe']).__name__}", "recipe")
        with naming("recipe"):
            steering = recipe_specs(parsed["recipe"], files=False)
    return steered_model(parsed.get("name"), steering, read, base_names)


class SteeredModelNames:
    """What the intake needs to serve steered names: the base model's names, the first of which a steered name
    is swapped for, and the registry that holds the recipes."""

    def __init__(self, registry: Any, base_names: Sequence[str]) -> None:
        self.registry = registry
        self.base_names = tuple(base_names)

    async def may_be_asked(self, body: bytes) -> bool:
        """Whether ``body`` may ask for a steered model, read before anything parses it: it holds a steered model's
        name as a JSON string, or a ``\\u`` escape (which may spell one); always where the registry is not held here
        (asking it would cost more than the parse)."""
        if not self.registry.local:
            return True
        names = await self.registry.call("model_names")
        return bool(names) and (b"\\u" in body or any(f'"{name}"'.encode() in body for name in names))

    async def recipe(self, name: Any) -> list[dict[str, Any]] | None:
        """The read specs of the steered model ``name`` (``None``: a base model's name, or no steered model's)."""
        if not isinstance(name, str) or name in self.base_names:
            return None
        return await self.registry.call("recipe", name)


class SteeredModelCards:
    """Mixed in front of vLLM's ``OpenAIServingModels``: ``/v1/models`` lists the steered names too, each with the
    base model as its ``parent``."""

    steering_registry: Any

    async def show_available_models(self) -> Any:
        from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelPermission

        listed = await super().show_available_models()
        base = self.base_model_paths[0]
        for name in await self.steering_registry.call("model_names"):
            listed.data.append(
                ModelCard(
                    id=name,
                    root=base.model_path,
                    parent=base.name,
                    max_model_len=self.model_config.max_model_len,
                    permission=[ModelPermission()],
                )
            )
        return listed


router = APIRouter()


@router.post(MODELS_PATH, status_code=HTTPStatus.CREATED.value)
async def register_model(raw_request: Request) -> JSONResponse:
    """Register a steered name (`read_model_registration`'s body): 201; 200 if it holds the same recipe; 409 if
    another, or if the registry is full; 400 naming the field of a bad recipe."""
    import asyncio

    state = raw_request.app.state
    engine = state.engine_client
    names = state.steered_model_names
    try:
        model = await asyncio.to_thread(
            read_model_registration, await raw_request.body(), state.read_steering, names.base_names
        )
        registered = await names.registry.call("get", sorted(named_vectors(model.read)))
        await asyncio.to_thread(check_recipe, model, registered, engine.saes)
    except InvalidField as error:
        return refusal(error)
    return registration_answer(
        await names.registry.call("add_model", model),
        f"another recipe is registered as {model.name!r}; DELETE {MODELS_PATH}/{model.name} first, or choose another "
        "name",
        f"the registry holds as many steered models as vectors at most ({state.args.max_steering_vectors}, "
        f"--max-steering-vectors); DELETE {MODELS_PATH}/NAME one no longer needed",
        _card(model.name, model.steering, names),
    )


def _card(name: str, steering: list[Any], names: SteeredModelNames) -> dict[str, Any]:
    return {"object": "steering.model", "name": name, "parent": names.base_names[0], "steering": steering}


@router.get(MODELS_PATH)
async def list_models(raw_request: Request) -> JSONResponse:
    """The steered names and their recipes: ``{"object": "list", "data": [{"name", "parent", "steering"}]}``."""
    names = raw_request.app.state.steered_model_names
    listed = await names.registry.call("model_listing")
    return JSONResponse({"object": "list", "data": [_card(name, steering, names) for name, steering in listed]})


@router.delete(MODELS_PATH + "/{name}")
async def delete_model(name: str, raw_request: Request) -> JSONResponse:
    """Forget a steered name (requests already admitted keep their steering); 404 if no steered model has it."""
    names = raw_request.app.state.steered_model_names
    if not await names.registry.call("remove_model", name):
        return error_json(f"no steered model is registered as {name!r}", "name", HTTPStatus.NOT_FOUND)
    return JSONResponse({"object": "steering.model.deleted", "name": name, "deleted": True})
