"""A client's bad input and how the server answers it: OpenAI's error format, ``param`` naming the field."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from http import HTTPStatus

from fastapi.responses import JSONResponse
from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse


class InvalidField(ValueError):
    """A client's bad input: the message says what was wrong and what would be right; ``param`` names the field."""

    def __init__(self, message: str, param: str | None, status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


@contextlib.contextmanager
def naming(param: str) -> Iterator[None]:
    """Inside the block, a ``ValueError``/``TypeError`` from a check becomes an `InvalidField` naming ``param``."""
    try:
        yield
    except InvalidField:
        raise
    except (ValueError, TypeError) as error:
        raise InvalidField(str(error), param) from None


def error_response(message: str, param: str | None, status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> ErrorResponse:
    """An error in OpenAI's format: ``{"error": {"message", "type": "invalid_request_error", "param", "code"}}``."""
    return ErrorResponse(error=ErrorInfo(message=message, type="invalid_request_error", param=param, code=status.value))


def error_json(
    message: str, param: str | None, status: HTTPStatus = HTTPStatus.BAD_REQUEST, detail: bool = False
) -> JSONResponse:
    """`error_response` as an HTTP response; with ``detail``, the message also as FastAPI's ``detail`` (which
    nnsight's client shows)."""
    body = error_response(message, param, status).model_dump()
    if detail:
        body["detail"] = message
    return JSONResponse(body, status_code=status.value)


def refusal(error: InvalidField) -> JSONResponse:
    """The HTTP answer to ``error``."""
    return error_json(str(error), error.param, error.status)


def registration_answer(outcome: str, conflict: str, full: str, answer: dict) -> JSONResponse:
    """The answer to a registration's ``outcome`` (``"created"``, ``"exists"``, ``"conflict"``, ``"full"``): 201 or
    200 with ``answer``; 409 naming ``name`` with the message of a ``conflict`` or of a ``full`` registry."""
    if outcome in ("conflict", "full"):
        return error_json(conflict if outcome == "conflict" else full, "name", HTTPStatus.CONFLICT)
    status = HTTPStatus.CREATED if outcome == "created" else HTTPStatus.OK
    return JSONResponse(answer, status_code=status.value)
