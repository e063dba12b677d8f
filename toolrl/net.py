"""What every HTTP service shares: bearer-token auth, capped bodies, JSON errors, uvicorn start-up.

Services bind 127.0.0.1 unless told otherwise and take an optional bearer token; clients send it
with `auth_headers`.
"""
from __future__ import annotations

import hmac
import logging
import sys
from typing import Callable

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

_bearer = HTTPBearer(auto_error=False)


def bearer_auth(token: str | None) -> Callable:
    """A FastAPI dependency that requires `Authorization: Bearer <token>` when a token is set."""

    async def check(creds: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
        if token is None:
            return
        if creds is None or not hmac.compare_digest(creds.credentials.encode(), token.encode()):
            raise HTTPException(status_code=401, detail="missing or wrong bearer token",
                                headers={"WWW-Authenticate": "Bearer"})

    return check


def auth_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


async def read_body_capped(request: Request, max_bytes: int) -> bytes:
    """The request body, refusing with 413 as soon as it passes `max_bytes` (never buffers more)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise HTTPException(status_code=413, detail=f"body of {declared} bytes is over the limit of {max_bytes}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise HTTPException(status_code=413, detail=f"body is over the limit of {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def install_error_handlers(app: FastAPI, log: logging.Logger) -> None:
    """Unexpected exceptions become a JSON 500 with the reason, logged, and the server keeps serving."""

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):  # pragma: no cover - last resort
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(status_code=500, content={"detail": f"internal error: {type(exc).__name__}: {exc}"})


def setup_logging(name: str, level: str = "INFO") -> logging.Logger:
    logging.basicConfig(level=level, stream=sys.stderr,
                        format=f"%(asctime)s {name} %(levelname)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "httpcore"):  # one line per request drowns the logs that matter
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return logging.getLogger(name)


def serve(app: FastAPI, host: str, port: int, log_level: str = "warning") -> None:
    import uvicorn

    if host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("toolrl").warning("binding %s: reachable from other machines; set a token", host)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_keep_alive=30)
