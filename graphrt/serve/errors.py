"""Errors the server answers with, in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

#: OpenAI's error type for each status the server answers with.
ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
    408: "timeout_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
    503: "server_error",
}


class ApiError(Exception):
    """A request the server refuses (or cannot serve): ``status`` and a message naming the problem;
    ``param``, the request field at fault, when one is."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)
