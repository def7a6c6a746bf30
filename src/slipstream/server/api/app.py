"""The aiohttp application: routes, JSON errors for everything, bearer auth, probes, metrics."""
from __future__ import annotations

import hmac
import logging

from aiohttp import web

from slipstream.server.api import kv_events, serving_chat, serving_completions, serving_responses, serving_tokenize, \
    tokenizer_files
from slipstream.server.api.errors import APIError, from_http_exception, served_routes
from slipstream.server.api.protocol import check_model
from slipstream.server.api.state import STATE, ServerOptions, ServerState
from slipstream.server.content_coding import refuse_undecodable_coding
from slipstream.server.metrics import CONTENT_TYPE
from slipstream.server.parse_errors import PAYLOAD_ERROR_CODE, payload_error_message
from slipstream.server.request_size import continue_within_limit, refuse_declared_oversize

logger = logging.getLogger("slipstream.server")
_OPEN_PATHS = ("/health", "/ready", "/metrics")


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:
    """Every failure becomes OpenAI's error body; never aiohttp's plain-text pages."""
    try:
        refuse_declared_oversize(request)
        refuse_undecodable_coding(request)
        return await handler(request)
    except APIError as exc:
        error = exc
    except web.RequestPayloadError as exc:  # a body aiohttp could not decode, e.g. gzip that is not;
        # aiohttp ends the connection after it, so the answer says so
        error = APIError(400, payload_error_message(exc), code=PAYLOAD_ERROR_CODE, close=True)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error = from_http_exception(exc, served_routes(request.app.router))
    except (ConnectionError, TimeoutError) as exc:  # the client went away mid-request: nobody to answer
        logger.debug("connection lost on %s: %s", request.path, exc)
        raise
    except Exception:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return APIError(500, "Internal server error; see the server log.", code="internal_error").response()
    logger.info("%s %s -> %d %s", request.method, request.path, error.status, error.message)
    return error.response()


@web.middleware
async def bearer_auth(request: web.Request, handler) -> web.StreamResponse:
    """``--api-key``: ``/v1/*`` needs ``Authorization: Bearer <key>``; probes and metrics stay open."""
    key = request.app[STATE].options.api_key
    if key and request.path.startswith("/v1"):
        given = request.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "Missing or incorrect API key: send the header 'Authorization: Bearer <key>'.",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return await handler(request)


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.draining:
        return web.json_response({"status": "draining"}, status=503)
    if not state.ready:
        return web.json_response({"status": "loading"}, status=503)
    stalled = state.stalled_for()
    if stalled is not None:  # the pod stays up: the step may end (or a collective time out and fail it)
        logger.warning("the engine step has run %.0f s (--step-timeout %g): /ready answers 503",
                       stalled, state.options.step_timeout)
        return web.json_response({"status": "stalled", "step_seconds": round(stalled, 1)}, status=503)
    return web.json_response({"status": "ready", "model": state.model_name})


def _model_card(state: ServerState, name: str) -> dict:
    return {"id": name, "object": "model", "created": state.created, "owned_by": "slipstream",
            "max_model_len": state.llm.max_model_len}


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.check_accepting()
    return web.json_response({"object": "list", "data": [_model_card(state, name) for name in state.model_names]})


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.check_accepting()
    name = request.match_info["model"]
    check_model(name, state.model_names)
    return web.json_response(_model_card(state, name))


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[STATE].metrics.render(), headers={"Content-Type": CONTENT_TYPE})


def build_app(options: ServerOptions, llm=None) -> web.Application:
    """The app; with ``llm`` (started and warmed up) it is ready at once, else call ``state.attach``
    and set ``state.ready`` once the engine is loaded (``slipstream.server.api.server`` does)."""
    app = web.Application(middlewares=[json_errors, bearer_auth], client_max_size=options.max_request_bytes)
    state = ServerState(options)
    app[STATE] = state
    if llm is not None:
        state.attach(llm)
        state.ready = True

    def post(path: str, handler) -> None:  # Expect: 100-continue only within the body limit
        app.router.add_post(path, handler, expect_handler=continue_within_limit)

    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    post("/v1/chat/completions", serving_chat.create_chat_completion)
    post("/v1/completions", serving_completions.create_completion)
    responses = serving_responses.ResponsesAPI()
    post("/v1/responses", responses.create)
    app.router.add_get("/v1/responses/{response_id}", responses.retrieve)
    post("/tokenize", serving_tokenize.tokenize)
    post("/detokenize", serving_tokenize.detokenize)
    app.router.add_get("/tokenizer_info", serving_tokenize.tokenizer_info)
    kv_events.add_routes(app)  # GET /v1/kv_events
    tokenizer_files.add_routes(app)  # GET /v1/tokenizer/files[/{name}]
    return app
