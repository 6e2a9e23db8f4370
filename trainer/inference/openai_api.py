"""The worker's OpenAI-compatible HTTP API, for Task Apps and any OpenAI client.

Routes: `GET /v1/models`; `GET /v1/models/{id}`; `POST /v1/chat/completions`; `POST /v1/completions`;
`POST /inference/v1/generate` (token ids in, token ids and log-probs out, vLLM's token-in/token-out shape);
and each of them under `/v1/traces/{correlation_id}/...`, the inference URL the trainer hands each episode
(`/v1/traces/{id}/inference/v1/generate` for the last, where a client that drops a trailing `/v1` from its
base URL and appends the route lands). A generation is recorded as a turn of its episode's trace when the
correlation id comes in the path or in the `X-Trace-Correlation-Id` header (the path wins). `stream: true`
answers with server-sent events, whose chunks carry OpenAI's `choices[].logprobs` for their tokens when
asked (not on the generate route, which refuses it).

Request fields understood: `model` (must be the served model when set), `messages` / `prompt` (text or
token ids), `max_tokens` / `max_completion_tokens` (at least 1), `temperature`, `top_p`, `top_k` and `min_p`
(vLLM's extensions, with its meaning: trainer/sampling.py), `stop` (string or list), `seed`, `logprobs` +
`top_logprobs` (chat) or `logprobs: N` (completions), `n` (1 to 16: sample 0 in the correlation id's trace,
sample i in `{id}:{i}`'s; seeds s, s + 1, ...), `chat_template_kwargs`. Fields no engine here honours are
refused naming them (`tandem_jobs.openai_fields`). The answer adds a `tandem` object: the weight
versions (the first and last token's, and `completion_weight_versions`, one per token) and the prompt and
completion token ids (and, with n > 1, each sample's as `samples`). Errors have
OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the mesh's stable reason as `code`
and the refused field as `param`; an unknown route is 404 NOT_FOUND. Each completion is a server span
continuing the caller's W3C `traceparent`.

The generate route takes `token_ids` (one prompt, or a list of prompts: a batch) and `sampling_params`
(`tandem_jobs.openai_fields.check_generate` lists what it honours and what it refuses), tokenises nothing
and answers each choice's `token_ids`, their log-probs (tokens named `token_id:<id>`), finish reason and
weight versions (`completion_weight_versions`: one per token); choice k = b * n + i is sample i of prompt
b, recorded in the trace `{id}` for k = 0 and `{id}:{k}` otherwise.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from opentelemetry import propagate, trace
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mesh.errors import FieldViolation, InvalidArgument, R, TandemError
from tandem_jobs.openai_fields import check_generate, generate_prompts, invalid, refuse_unsupported
from trainer.inference.engine import Finished, PromptTooLong, Sampling, TokenChunk
from trainer.inference.traces import token_versions

if TYPE_CHECKING:
    from trainer.inference.worker import InferenceWorker

CORRELATION_HEADER = "x-trace-correlation-id"
_tracer = trace.get_tracer("tandem.inference.openai")
MAX_BODY_BYTES = 16 * 1024 * 1024
HTTP_STATUS = {
    "INVALID_ARGUMENT": 400,
    "FAILED_PRECONDITION": 404,  # the model is not served here (MODEL_NOT_FOUND)
    "NOT_FOUND": 404,
    "UNAVAILABLE": 503,
    "UNAUTHENTICATED": 401,
    "RESOURCE_EXHAUSTED": 413,
}


ERROR_TYPE = {401: "authentication_error", 404: "not_found_error"}


def _error_body(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    kind = ERROR_TYPE.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _error(status: int, message: str, code: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(_error_body(status, message, code, param), status_code=status)


def _unauthorized() -> JSONResponse:
    return _error(401, "a valid API key is required", "INVALID_CREDENTIALS")


def _from_domain(error: TandemError) -> JSONResponse:
    status = HTTP_STATUS.get(error.code, 500)
    if error.reason == R.ERROR_REASON_TRACE_FINISHED:
        status = 409
    param = error.violations[0].field if error.violations else None
    return _error(status, error.message, error.reason_name, param)


async def _internal_error(request: Request, exc: Exception) -> Response:
    """A failure no handler expected: 500 as an OpenAI error (the exception is still logged)."""
    return _error(500, "internal error", "INTERNAL")


async def _route_error(request: Request, exc: Exception) -> Response:
    """An unknown route (404 NOT_FOUND) or method (405 NOT_IMPLEMENTED) as an OpenAI error."""
    if not isinstance(exc, HTTPException):
        raise exc
    if exc.status_code == 405:
        return _error(405, f"{request.method} is not a method of {request.url.path}", "NOT_IMPLEMENTED")
    message = f"{request.method} {request.url.path} is not a route of this endpoint"
    return _error(exc.status_code, message, "NOT_FOUND")


def _number(body: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise InvalidArgument(f"`{key}` must be a number from {low:g} to {high:g}")
    return float(value)


def _whole(body: dict[str, Any], key: str, high: int) -> int:
    """A whole number from 0 to `high` (vLLM's `top_k` also takes -1 for "every token", as 0 does here)."""
    value = body.get(key)
    if value is None or value == -1:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
        raise InvalidArgument(f"`{key}` must be a whole number from 0 to {high} (or -1)")
    return value


def _sampling(body: dict[str, Any], chat: bool) -> Sampling:
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > 16:
        raise InvalidArgument("`stop` must be a string or a list of at most 16 strings")
    refuse_unsupported(body)  # a token budget of 0, `n` out of range, fields no engine here honours
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens")) or 0
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise InvalidArgument("`seed` must be a non-negative integer")
    if chat:
        if body.get("top_logprobs") and not body.get("logprobs"):
            raise invalid("top_logprobs", "needs `logprobs: true`")
        top = int(_number(body, "top_logprobs", 0, 0, 20)) if body.get("logprobs") else 0
    else:
        top = int(_number(body, "logprobs", 0, 0, 20))
    return Sampling(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-6, 1.0),
        top_k=_whole(body, "top_k", 1_000_000),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        max_tokens=max_tokens,
        stop=tuple(stops),
        seed=seed,
        top_logprobs=top,
    )


def _generate_sampling(params: dict[str, Any]) -> Sampling:
    """The engine's sampling of a generate request's `sampling_params`, already checked (`check_generate`)."""
    return Sampling(
        temperature=float(params["temperature"]) if params.get("temperature") is not None else 1.0,
        top_p=float(params.get("top_p") or 1.0),
        top_k=max(int(params.get("top_k") or 0), 0),
        min_p=float(params.get("min_p") or 0.0),
        max_tokens=int(params.get("max_tokens") or 0),
        stop_token_ids=tuple(params.get("stop_token_ids") or ()),
        seed=params.get("seed"),
        top_logprobs=int(params.get("logprobs") or 0),
    )


def _server_span(request: Request, name: str) -> AbstractContextManager[trace.Span]:
    """The request's server span, a child of the caller's `traceparent` (a Task App's policy call), so a
    generation is part of its rollout's trace."""
    return _tracer.start_as_current_span(
        name,
        context=propagate.extract(request.headers),
        kind=trace.SpanKind.SERVER,
        attributes={"http.request.method": request.method, "url.path": request.url.path},
    )


class OpenAIApi:
    def __init__(self, worker: InferenceWorker) -> None:
        self.worker = worker

    def _authorized(self, request: Request) -> bool:
        key = self.worker.settings.openai_api_key
        if not key:
            return True
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(given.encode(), key.encode())

    async def _body(self, request: Request) -> dict[str, Any]:
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise InvalidArgument(f"the body is larger than {MAX_BODY_BYTES} bytes")
        try:
            body = json.loads(raw)
        except ValueError:
            raise InvalidArgument("the body is not JSON", reason=R.ERROR_REASON_MALFORMED_REQUEST) from None
        if not isinstance(body, dict):
            raise InvalidArgument("the body must be a JSON object", reason=R.ERROR_REASON_MALFORMED_REQUEST)
        return body

    def _correlation_id(self, request: Request) -> str:
        cid: str = request.path_params.get("correlation_id") or request.headers.get(CORRELATION_HEADER, "")
        if cid and (len(cid) > 128 or not all(c.isalnum() or c in "._:-" for c in cid)):
            raise InvalidArgument("the correlation id must be 1-128 characters of A-Z a-z 0-9 . _ : -")
        return cid

    async def health(self, request: Request) -> Response:
        """200 while the worker serves; needs no key (for readiness probes, as vLLM's `/health`). The body
        says how long the worker has been idle and after how long idle it exits (0: never), for the
        gateway's `ListInferenceWorkers`; it names no model and no weights."""
        settings = self.worker.settings
        return JSONResponse(
            {"status": "ok", "idle_s": round(self.worker.idle_s(), 3), "idle_exit_s": settings.idle_exit_s}
        )

    def _model(self) -> dict[str, Any]:
        model = self.worker.engine.info
        return {
            "id": model.model,
            "object": "model",
            "created": int(self.worker.start_time),
            "owned_by": "tandem",
            "max_model_len": model.max_context_tokens,
        }

    async def models(self, request: Request) -> Response:
        if not self._authorized(request):
            return _unauthorized()
        return JSONResponse({"object": "list", "data": [self._model()]})

    async def model(self, request: Request) -> Response:
        """`GET /v1/models/{id}`: the served model; 404 MODEL_NOT_FOUND for any other id."""
        if not self._authorized(request):
            return _unauthorized()
        model = request.path_params["model"]
        if model != self.worker.engine.info.model:
            return _error(
                404, f"this worker serves {self.worker.engine.info.model!r}, not {model!r}", "MODEL_NOT_FOUND"
            )
        return JSONResponse(self._model())

    async def chat(self, request: Request) -> Response:
        with _server_span(request, "openai.chat_completions"):
            return await self._complete(request, chat=True)

    async def completions(self, request: Request) -> Response:
        with _server_span(request, "openai.completions"):
            return await self._complete(request, chat=False)

    async def _complete(self, request: Request, *, chat: bool) -> Response:
        if not self._authorized(request):
            return _unauthorized()
        try:
            body = await self._body(request)
            cid = self._correlation_id(request)
            self.worker.check_model(str(body.get("model") or ""))
            sampling = _sampling(body, chat)
            prompt = self._prompt(body, chat)
            samples = _samples(sampling, cid, int(body.get("n") or 1))
            generations = [self.worker.generate(prompt, s.sampling, s.correlation_id) for s in samples]
            firsts = await _first_items(generations)  # errors before the first token still get a status
        except TandemError as error:
            return _from_domain(error)
        except StopAsyncIteration:
            return _error(500, "the engine ended without an answer", "INTERNAL")
        created = int(time.time())
        ident = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        model = self.worker.engine.info.model
        want_logprobs = bool(body.get("logprobs")) if chat else body.get("logprobs") is not None
        runs = [_Run(s, f, g) for s, f, g in zip(samples, firsts, generations, strict=True)]
        if body.get("stream"):
            return StreamingResponse(
                self._events(runs, ident, created, model, chat, len(prompt), want_logprobs),
                media_type="text/event-stream",
            )
        collected = await asyncio.gather(*(run.collect() for run in runs), return_exceptions=True)
        results = [c for c in collected if not isinstance(c, BaseException)]
        for failed in collected:
            if isinstance(failed, TandemError):  # the engine failed mid-generation
                return _from_domain(failed)
            if isinstance(failed, BaseException):
                raise failed
        return JSONResponse(
            self._answer(results, samples, ident, created, model, chat, prompt, want_logprobs)
        )

    async def generate(self, request: Request) -> Response:
        """`POST /inference/v1/generate`: token ids in, token ids and their log-probs out (vLLM's
        token-in/token-out shape); nothing is tokenised or detokenised."""
        with _server_span(request, "inference.generate"):
            return await self._generate(request)

    async def _generate(self, request: Request) -> Response:
        if not self._authorized(request):
            return _unauthorized()
        try:
            body = await self._body(request)
            cid = self._correlation_id(request)
            self.worker.check_model(str(body.get("model") or ""))
            params = check_generate(body)
            prompts, batch = generate_prompts(body)
            for index, prompt in enumerate(prompts):
                self._check_prompt(prompt, f"token_ids[{index}]" if batch else "token_ids")
            choices = _generate_choices(
                _generate_sampling(params), cid, len(prompts), int(params.get("n") or 1)
            )
            generations = [
                self.worker.generate(prompts[c.prompt], c.sample.sampling, c.sample.correlation_id)
                for c in choices
            ]
            firsts = await _first_items(generations)
            runs = [_Run(c.sample, f, g) for c, f, g in zip(choices, firsts, generations, strict=True)]
            collected = await asyncio.gather(*(run.collect() for run in runs), return_exceptions=True)
            for failed in collected:
                if isinstance(failed, BaseException):  # the engine failed mid-generation
                    raise failed
        except TandemError as error:
            return _from_domain(error)
        except StopAsyncIteration:
            return _error(500, "the engine ended without an answer", "INTERNAL")
        results = [c for c in collected if not isinstance(c, BaseException)]
        want_top = bool(params.get("logprobs"))
        answers = []
        completion = 0
        for index, (choice, (chunks, finished)) in enumerate(zip(choices, results, strict=True)):
            tokens = [t for c in chunks for t in c.token_ids]
            completion += len(tokens)
            answer: dict[str, Any] = {
                "index": index,
                "prompt_index": choice.prompt,
                "token_ids": tokens,
                "logprobs": {"content": _token_logprobs(chunks, want_top)},
                "finish_reason": finished.reason if finished else "abort",
                "weight_version": finished.weight_version if finished else self.worker.engine.weight_version,
                "last_weight_version": finished.last_weight_version if finished else 0,
                "completion_weight_versions": _token_versions(chunks, finished),
            }
            if choice.sample.correlation_id:
                answer["correlation_id"] = choice.sample.correlation_id
            answers.append(answer)
        prompt_tokens = sum(len(prompts[c.prompt]) for c in choices)
        return JSONResponse(
            {
                "request_id": body.get("request_id") or "gen-" + secrets.token_hex(12),
                "model": self.worker.engine.info.model,
                "choices": answers,
                "prompt_token_ids": prompts if batch else prompts[0],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion,
                    "total_tokens": prompt_tokens + completion,
                },
            }
        )

    def _check_prompt(self, prompt: list[int], field: str) -> None:
        """A prompt's ids inside the model's vocabulary, and room left in the context to generate."""
        info = self.worker.engine.info
        if info.vocab_size:
            for index, token in enumerate(prompt):
                if token >= info.vocab_size:
                    raise invalid(
                        f"{field}[{index}]",
                        f"is {token}, outside the model's vocabulary (ids 0 to {info.vocab_size - 1})",
                    )
        if len(prompt) >= info.max_context_tokens:
            message = str(PromptTooLong(len(prompt), info.max_context_tokens))
            raise InvalidArgument(
                f"`{field}`: {message}",
                reason=R.ERROR_REASON_CONTEXT_LENGTH_EXCEEDED,
                violations=[FieldViolation(field, message)],
                metadata={
                    "max_context_tokens": str(info.max_context_tokens),
                    "prompt_tokens": str(len(prompt)),
                },
            )

    def _prompt(self, body: dict[str, Any], chat: bool) -> list[int]:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise InvalidArgument("`messages` must be a non-empty list")
            rendered = [_message(index, message) for index, message in enumerate(messages)]
            kwargs = body.get("chat_template_kwargs") or {}
            if not isinstance(kwargs, dict):
                raise InvalidArgument("`chat_template_kwargs` must be an object")
            return self.worker.prompt_from_messages(rendered, kwargs)
        prompt = body.get("prompt")
        if isinstance(prompt, str) and prompt:
            return self.worker.engine.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt):
            vocab = self.worker.engine.info.vocab_size
            for index, token in enumerate(prompt if vocab else ()):
                if token >= vocab:
                    raise invalid(
                        f"prompt[{index}]",
                        f"is {token}, outside the model's vocabulary (ids 0 to {vocab - 1})",
                    )
            return [int(t) for t in prompt]
        raise InvalidArgument("`prompt` must be non-empty text or a list of token ids")

    def _logprobs(self, chunks: list[TokenChunk], chat: bool) -> dict[str, Any]:
        decode = self.worker.engine.decode
        tokens = [t for c in chunks for t in c.token_ids]
        values = [p for c in chunks for p in c.logprobs]
        tops = [top for c in chunks for top in c.top_logprobs]
        if chat:
            content = []
            for index, (token, value) in enumerate(zip(tokens, values, strict=True)):
                entry: dict[str, Any] = {"token": decode([token]), "logprob": value, "token_id": token}
                if index < len(tops):
                    entry["top_logprobs"] = [
                        {"token": decode([t]), "logprob": p, "token_id": t} for t, p in tops[index]
                    ]
                content.append(entry)
            return {"content": content}
        return {
            "tokens": [decode([t]) for t in tokens],
            "token_logprobs": values,
            "top_logprobs": [{decode([t]): p for t, p in top} for top in tops] or None,
        }

    def _answer(
        self,
        results: list[tuple[list[TokenChunk], Finished | None]],
        samples: list[_Sample],
        ident: str,
        created: int,
        model: str,
        chat: bool,
        prompt: list[int],
        want_logprobs: bool,
    ) -> dict[str, Any]:
        choices: list[dict[str, Any]] = []
        extras: list[dict[str, Any]] = []
        for index, (chunks, finished) in enumerate(results):
            text = "".join(c.text for c in chunks)
            choice: dict[str, Any] = {
                "index": index,
                "finish_reason": finished.reason if finished else "abort",
            }
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choice["logprobs"] = self._logprobs(chunks, chat) if want_logprobs else None
            choices.append(choice)
            extra: dict[str, Any] = {
                "weight_version": finished.weight_version if finished else self.worker.engine.weight_version,
                "last_weight_version": finished.last_weight_version if finished else 0,
                "completion_token_ids": [t for c in chunks for t in c.token_ids],
                "completion_logprobs": [p for c in chunks for p in c.logprobs],
                "completion_weight_versions": _token_versions(chunks, finished),
            }
            if samples[index].correlation_id:
                extra["correlation_id"] = samples[index].correlation_id
            extras.append(extra)
        completion = sum(len(e["completion_token_ids"]) for e in extras)
        tandem: dict[str, Any] = {**extras[0], "prompt_token_ids": prompt}
        tandem.pop("correlation_id", None)
        if len(extras) > 1:
            tandem["samples"] = [{"index": i, **e} for i, e in enumerate(extras)]
        return {
            "id": ident,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": completion,
                "total_tokens": len(prompt) + completion,
            },
            "tandem": tandem,
        }

    async def _events(
        self,
        runs: list[_Run],
        ident: str,
        created: int,
        model: str,
        chat: bool,
        prompt_tokens: int,
        want_logprobs: bool,
    ) -> AsyncIterator[bytes]:
        """Server-sent events: a chunk per engine chunk of each sample (its choice `index`), each with its
        tokens' `logprobs` when asked and a `tandem` object; the usage comes with the last sample's finish."""
        try:
            async for event in self._chunks(runs, ident, created, model, chat, prompt_tokens, want_logprobs):
                yield event
        except TandemError as error:  # after the status went out: an error event, which the client raises
            body = _error_body(HTTP_STATUS.get(error.code, 500), error.message, error.reason_name)
            yield f"data: {json.dumps(body)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    async def _chunks(
        self,
        runs: list[_Run],
        ident: str,
        created: int,
        model: str,
        chat: bool,
        prompt_tokens: int,
        want_logprobs: bool,
    ) -> AsyncIterator[bytes]:
        kind = "chat.completion.chunk" if chat else "text_completion"
        completion = 0
        left = len(runs)
        async for index, item in _merged(runs):
            choice: dict[str, Any] = {"index": index, "finish_reason": None}
            if isinstance(item, TokenChunk):
                completion += len(item.token_ids)
                if chat:
                    choice["delta"] = {"role": "assistant", "content": item.text}
                else:
                    choice["text"] = item.text
                choice["logprobs"] = self._logprobs([item], chat) if want_logprobs else None
                extra: dict[str, Any] = {
                    "token_ids": item.token_ids,
                    "logprobs": item.logprobs,
                    "weight_version": item.weight_version,
                }
            else:
                left -= 1
                choice["finish_reason"] = item.reason
                if chat:
                    choice["delta"] = {}
                else:
                    choice["text"] = ""
                choice["logprobs"] = None
                extra = {
                    "weight_version": item.weight_version,
                    "last_weight_version": item.last_weight_version,
                }
                if runs[index].sample.correlation_id:
                    extra["correlation_id"] = runs[index].sample.correlation_id
            payload: dict[str, Any] = {
                "id": ident,
                "object": kind,
                "created": created,
                "model": model,
                "choices": [choice],
                "tandem": extra,
            }
            if isinstance(item, Finished) and not left:
                payload["usage"] = {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion,
                    "total_tokens": prompt_tokens + completion,
                }
            yield f"data: {json.dumps(payload)}\n\n".encode()


def _message(index: int, message: object) -> dict[str, str]:
    """A chat message as the template renders it: its role and its text (content parts, text only, joined)."""
    if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant", "tool"):
        raise InvalidArgument(f"messages[{index}] needs a role: system, user, assistant or tool")
    for field in ("tool_calls", "function_call"):  # this endpoint calls no tools (openai_fields)
        if message.get(field):
            raise invalid(f"messages[{index}].{field}", "is not supported by this endpoint")
    content = message.get("content") or ""
    if isinstance(content, list):
        for part_index, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                field = f"messages[{index}].content[{part_index}]"
                raise invalid(field, "is not a text part: this endpoint reads text only")
        content = "".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str):
        raise InvalidArgument(f"messages[{index}].content must be text")
    return {"role": message["role"], "content": content}


@dataclass(frozen=True)
class _Sample:
    sampling: Sampling
    correlation_id: str


def _samples(sampling: Sampling, cid: str, n: int) -> list[_Sample]:
    """The `n` samples of one request: sample 0 is recorded in the trace of the request's correlation id and
    sample i > 0 in `{id}:{i}`'s, each its own trace; a seed s samples them with seeds s, s + 1, ..."""
    found = []
    for index in range(n):
        own = cid if not index or not cid else f"{cid}:{index}"
        if len(own) > 128:
            raise invalid("n", "gives correlation ids past 128 characters: use a shorter correlation id")
        seed = sampling.seed + index if sampling.seed is not None else None
        found.append(_Sample(replace(sampling, seed=seed), own))
    return found


@dataclass(frozen=True)
class _Choice:
    """One choice of a generate request: which prompt of the batch, and its sample."""

    prompt: int
    sample: _Sample


def _generate_choices(sampling: Sampling, cid: str, prompts: int, n: int) -> list[_Choice]:
    """Choice k = b * n + i of a generate request is sample i of prompt b: recorded in the correlation id's
    trace for k = 0 and in `{id}:{k}`'s for k > 0, each its own trace; a seed s samples prompt b's n samples
    with seeds s, s + 1, ..., as `n` does alone."""
    found = []
    for prompt in range(prompts):
        for index in range(n):
            k = prompt * n + index
            own = cid if not k or not cid else f"{cid}:{k}"
            if len(own) > 128:
                raise invalid(
                    "sampling_params.n",
                    "gives correlation ids past 128 characters: use a shorter correlation id",
                )
            seed = sampling.seed + index if sampling.seed is not None else None
            found.append(_Choice(prompt, _Sample(replace(sampling, seed=seed), own)))
    return found


def _token_logprobs(chunks: list[TokenChunk], top: bool) -> list[dict[str, Any]]:
    """Each sampled token's log-prob as vLLM's generate route answers them, tokens named `token_id:<id>`
    (nothing is detokenised), with its `top_logprobs` when asked."""
    tokens = [t for c in chunks for t in c.token_ids]
    values = [p for c in chunks for p in c.logprobs]
    tops = [candidates for c in chunks for candidates in c.top_logprobs]
    content = []
    for index, (token, value) in enumerate(zip(tokens, values, strict=True)):
        entry: dict[str, Any] = {"token": f"token_id:{token}", "logprob": value, "bytes": None}
        if top:
            entry["top_logprobs"] = [
                {"token": f"token_id:{t}", "logprob": p, "bytes": None}
                for t, p in (tops[index] if index < len(tops) else [])
            ]
        content.append(entry)
    return content


async def _first_items(
    generations: list[AsyncIterator[TokenChunk | Finished]],
) -> list[TokenChunk | Finished]:
    """The first item of each generation, all started at once; when one fails, every one is closed."""

    async def first(generation: AsyncIterator[TokenChunk | Finished]) -> TokenChunk | Finished:
        return await anext(generation)

    found = await asyncio.gather(*(first(g) for g in generations), return_exceptions=True)
    failed = [f for f in found if isinstance(f, BaseException)]
    if failed:
        for generation in generations:
            await generation.aclose()  # type: ignore[attr-defined]
        raise failed[0]
    return [f for f in found if not isinstance(f, BaseException)]


@dataclass
class _Run:
    """One sample's generation, its first item already taken."""

    sample: _Sample
    first: TokenChunk | Finished
    generation: AsyncIterator[TokenChunk | Finished]

    async def items(self) -> AsyncIterator[TokenChunk | Finished]:
        yield self.first
        async for item in self.generation:
            yield item

    async def collect(self) -> tuple[list[TokenChunk], Finished | None]:
        chunks: list[TokenChunk] = []
        async for item in self.items():
            if isinstance(item, Finished):
                return chunks, item
            chunks.append(item)
        return chunks, None


def _token_versions(chunks: list[TokenChunk], finished: Finished | None) -> list[int]:
    """Each completion token's weight version, as its trace turn records it (`completion_weight_versions`)."""
    reported = [c.weight_version for c in chunks for _ in c.token_ids]
    if finished is None:
        return reported
    return token_versions(len(reported), reported, finished.weight_version, finished.last_weight_version)


async def _merged(runs: list[_Run]) -> AsyncIterator[tuple[int, TokenChunk | Finished]]:
    """The items of every run as they come, each with its run's index; one run reads inline, more through
    a task each, cancelled (ending their generations as aborted turns) when the reader stops early."""
    if len(runs) == 1:
        async for item in runs[0].items():
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, TokenChunk | Finished | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, run: _Run) -> None:
        try:
            async for item in run.items():
                await queue.put((index, item))
        except Exception as exc:
            await queue.put((index, exc))
        else:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, run)) for i, run in enumerate(runs)]
    try:
        running = len(tasks)
        while running:
            index, got = await queue.get()
            if got is None:
                running -= 1
            elif isinstance(got, BaseException):
                raise got
            else:
                yield index, got
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def openai_app(worker: InferenceWorker) -> Starlette:
    api = OpenAIApi(worker)
    return Starlette(
        exception_handlers={HTTPException: _route_error, Exception: _internal_error},
        routes=[
            Route("/health", api.health, methods=["GET"]),
            Route("/v1/models", api.models, methods=["GET"]),
            Route("/v1/models/{model:path}", api.model, methods=["GET"]),
            Route("/v1/chat/completions", api.chat, methods=["POST"]),
            Route("/v1/completions", api.completions, methods=["POST"]),
            Route("/v1/traces/{correlation_id}/models", api.models, methods=["GET"]),
            Route("/v1/traces/{correlation_id}/models/{model:path}", api.model, methods=["GET"]),
            Route("/v1/traces/{correlation_id}/chat/completions", api.chat, methods=["POST"]),
            Route("/v1/traces/{correlation_id}/completions", api.completions, methods=["POST"]),
            Route("/inference/v1/generate", api.generate, methods=["POST"]),
            Route("/v1/traces/{correlation_id}/inference/v1/generate", api.generate, methods=["POST"]),
        ],
    )
