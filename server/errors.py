"""The one error mapper: every failure leaves as an OpenAI-shaped JSON error."""

from __future__ import annotations

from dataclasses import dataclass

import orjson
from aiohttp import web


@dataclass
class ApiError(Exception):
    status: int
    message: str
    type: str = "BadRequestError"
    param: str | None = None
    code: int | str | None = None
    close_connection: bool = False  # the request's bytes cannot be trusted: no keep-alive after it

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }

    def response(self) -> web.Response:
        response = web.Response(status=self.status, body=orjson.dumps(self.body()), content_type="application/json")
        if self.close_connection:
            response.force_close()
        return response


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "BadRequestError", param, code)


def not_found(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(404, message, "NotFoundError", param, code)


def unauthorized() -> ApiError:
    return ApiError(401, "Invalid or missing API key.", "AuthenticationError")


def overloaded(message: str) -> ApiError:
    return ApiError(503, message, "ServiceUnavailableError")


def internal_error() -> ApiError:
    return ApiError(500, "Internal server error.", "InternalServerError")
