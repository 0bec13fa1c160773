"""The playground: a page of the server (``GET /playground``, ``GET /`` leads there) to try steering in a browser.

Its files (``static/``) ship in the package and are served by the server itself, behind ``--api-key`` as every
route is. A browser's first navigation cannot send ``Authorization``, so `GuardEveryRoute` answers the page,
without a key, with a sign-in form (`sign_in`): the key POSTed there comes back as an HttpOnly, SameSite=Strict
cookie (`KEY_COOKIE`) that the guard accepts as the key on same-origin requests. The key never travels in a URL,
so no access log or browser history holds it.
"""

from __future__ import annotations

from collections.abc import Callable
from http import HTTPStatus
from pathlib import Path
from string import Template
from urllib.parse import parse_qs

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse
from starlette.datastructures import Headers
from starlette.responses import HTMLResponse, Response
from starlette.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send

STATIC = Path(__file__).parent / "static"
PAGE_PATH = "/playground"
#: The paths a browser opens first: answered with the sign-in form while it holds no key.
PAGE_PATHS = ("/", PAGE_PATH)
#: The cookie holding the key a browser signed in with.
KEY_COOKIE = "nnterp_vllm_key"
#: Bytes of a sign-in form read at most (a key and its field name).
MAX_FORM_BYTES = 8192

router = APIRouter()


@router.get("/", include_in_schema=False)
async def root() -> RedirectResponse:
    """The playground."""
    return RedirectResponse(PAGE_PATH, status_code=HTTPStatus.SEE_OTHER.value)


@router.get(PAGE_PATH, include_in_schema=False)
async def page() -> FileResponse:
    """The playground's page."""
    return FileResponse(STATIC / "index.html", media_type="text/html")


@router.get(PAGE_PATH + "/model.json", include_in_schema=False)
async def model(raw_request: Request) -> JSONResponse:
    """What the page offers to steer: ``{"num_layers", "hidden_size", "saes": [{"name", "layer", "features"}]}``."""
    engine = raw_request.app.state.engine_client
    saes = [
        {"name": name, "layer": sae.layer, "features": int(sae.W_dec.shape[0])}
        for name, sae in sorted(engine.saes.items())
    ]
    return JSONResponse({"num_layers": engine.num_layers, "hidden_size": engine.hidden_size, "saes": saes})


def attach(app: FastAPI) -> None:
    """Serve the playground on ``app``: the page, what it offers, its script and style."""
    app.include_router(router)
    app.mount(PAGE_PATH + "/static", StaticFiles(directory=STATIC), name="playground")


def sign_in_page(message: str = "", status: HTTPStatus = HTTPStatus.UNAUTHORIZED) -> HTMLResponse:
    """The sign-in form, with ``message`` saying why the last try was refused."""
    form = Template((STATIC / "sign-in.html").read_text())
    alert = f'<p role="alert" id="refused">{message}</p>' if message else ""
    return HTMLResponse(form.substitute(refused=alert, action=PAGE_PATH), status_code=status.value)


def same_origin(scope: Scope, headers: Headers) -> bool:
    """Whether a request comes from the server's own pages: its ``Origin`` (which a browser sends on every
    cross-origin request and every POST) is absent or the server's own."""
    origin = headers.get("origin")
    return origin is None or origin == f"{scope.get('scheme', 'http')}://{headers.get('host', '')}"


async def read_form(receive: Receive) -> dict[str, str] | None:
    """A urlencoded form's fields (the first value of each), or ``None`` past `MAX_FORM_BYTES`."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if len(body) > MAX_FORM_BYTES:
            return None
        if not message.get("more_body", False):
            break
    return {name: values[0] for name, values in parse_qs(body.decode("utf-8", "replace")).items()}


async def sign_in(scope: Scope, receive: Receive, send: Send, headers: Headers, valid: Callable[[str], bool]) -> None:
    """Answer a page path of a request holding no key: the form on GET; on POST of the form, a redirect to the
    page setting `KEY_COOKIE` where the key is ``valid``, else the form again saying what was wrong."""
    response: Response
    if scope.get("method") != "POST":
        response = sign_in_page()
    elif not same_origin(scope, headers):
        response = sign_in_page("Sign in from this server's own page.", HTTPStatus.FORBIDDEN)
    else:
        form = await read_form(receive)
        key = (form or {}).get("key", "")
        if not key or not valid(key):
            response = sign_in_page("That is not a key this server was started with (--api-key): enter one of those.")
        else:
            response = RedirectResponse(PAGE_PATH, status_code=HTTPStatus.SEE_OTHER.value)
            response.set_cookie(
                KEY_COOKIE,
                key,
                path="/",
                httponly=True,
                samesite="strict",
                secure=scope.get("scheme") == "https",
            )
    await response(scope, receive, send)
