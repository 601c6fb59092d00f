"""The Responses API on an ingress: ``POST /v1/responses`` with what needs state (``store``,
``previous_response_id``, ``background``) and the routes on a stored response (``GET``,
``DELETE``, ``POST .../cancel``, ``GET .../input_items``). `ResponsesApi` has no HTTP in it:
``ingress/http_app.py`` puts the routes around it; the ``IngressServer`` that owns it
(ingress/openai_server.py) is passed to `create`, which answers through it.

A request enters parsed (`ResponsesRequest`). `resolve`, on the event loop before the
request is prepared, checks the stored-response fields and gives the request the items of
its ``previous_response_id`` (that response's input items, then its output items:
OpenAI's rule; its ``instructions`` are not carried over). `prepare`, in a worker thread,
prepares the chat request it maps to (openai/responses_input.py) and, when the response
will be stored, the items it is stored with (`PreparedResponse`). `create` answers: the
response object, the event stream (openai/responses_output.py ``ResponseStream``, written
from the choice's updates as the chat stream is), or for ``background`` the response
``in_progress`` at once while a task generates it. A response leaves into the
`ResponseStore` (ingress/response_store.py) as it ends (a stream: before its last event),
unless ``store`` is false.

Cancelling applies to background responses (OpenAI's rule: a foreground one is answered
"Cannot cancel a synchronous response."): the task and its choices are cancelled, which
aborts the request on every model (its KV freed), and the stored response says
``cancelled``. Deleting a background response that still runs cancels it the same way.
The store is this replica's: with several ingress replicas a response is found only on
the one that made it (docs/reference/api.md, "Stored responses").
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from tokenrouter_ray.ingress.response_store import ResponseStore, StoredResponse, json_size
from tokenrouter_ray.openai.errors import (
    InvalidRequestError,
    NotFoundError,
    OpenAIError,
    as_openai_error,
)
from tokenrouter_ray.openai.generation_defaults import GenerationDefaults
from tokenrouter_ray.openai.responses_input import (
    RESPONSE_ID_PREFIX,
    ResponsesRequest,
    prepare_responses,
    stored_items,
)
from tokenrouter_ray.openai.responses_output import (
    ResponseObject,
    ResponseStream,
    build_response,
    cancelled,
    failed,
    response_head,
)
from tokenrouter_ray.openai.validation import PreparedRequest, RequestLimits

logger = logging.getLogger(__name__)
MAX_LIST_LIMIT = 100  # input_items' ``limit`` (OpenAI's range: 1..100, default 20)


class ChatAnswers(Protocol):
    """What a response is answered through: the ``IngressServer`` (ingress/openai_server.py)
    that owns this API: a chat request's answer (``respond``: the completion, or the stream
    ``writer`` writes), and a background one's choices (``start``, then ``collect``)."""

    async def respond(
        self, prepared: Any, chat: bool, timeout_s: float | None = None, writer: Any = None
    ) -> Any: ...

    async def start(
        self, prepared: Any, chat: bool, timeout_s: float | None = None
    ) -> list[asyncio.Task]: ...

    async def collect(self, prepared: Any, tasks: list[asyncio.Task], chat: bool) -> Any: ...


@dataclass(frozen=True)
class PreparedResponse(PreparedRequest):
    """A prepared Responses request and the input items its response is stored with (the
    context of ``previous_response_id`` first; None: ``store`` false)."""

    items: list[dict[str, Any]] | None = None
    items_bytes: int = 0


class ResponsesApi:
    """Creating, storing, reading, cancelling and deleting responses (the module docstring)
    in this replica's ``store``."""

    def __init__(
        self, store: ResponseStore, served_model_name: str, ingress_replicas: int = 1
    ) -> None:
        self.store = store
        self.served_model_name = served_model_name
        self.ingress_replicas = ingress_replicas

    # ------------------------------------------------------------------ create
    def resolve(self, request: ResponsesRequest) -> None:
        """Check ``background`` and ``previous_response_id``, and give the request the
        stored items it continues (on the event loop: the store is read here only)."""
        if request.background and not request.stored:
            raise InvalidRequestError(
                "A background response must be stored: 'background' needs 'store' true (its "
                "default).",
                param="background",
                code="invalid_value",
            )
        if request.background and request.stream:
            raise InvalidRequestError(
                "Streaming a background response is not supported by this server: poll GET "
                "/v1/responses/{id} instead, or stream without background.",
                param="stream",
                code="unsupported_value",
            )
        if request.previous_response_id is None:
            return
        entry = self._find(request.previous_response_id, "previous_response_id")
        if entry.running:
            raise InvalidRequestError(
                f"Previous response '{request.previous_response_id}' is still in progress; "
                "continue it once it has ended.",
                param="previous_response_id",
                code="invalid_value",
            )
        request.continue_from([*entry.items, *entry.response["output"]])

    def prepare(
        self,
        request: ResponsesRequest,
        tokenizer: Any,
        limits: RequestLimits,
        defaults: GenerationDefaults | None = None,
    ) -> PreparedResponse:
        """The chat request ``request`` maps to, prepared, with the items it will be stored
        with (a worker thread: no store access). Items larger than the store are a 400."""
        prepared = prepare_responses(request, tokenizer, limits, defaults)
        items, size = None, 0
        if request.stored:
            items = [*request.context, *stored_items(request)]
            size = json_size(items)
            if size > self.store.max_bytes:
                raise self._too_large(size)
        fields = {f.name: getattr(prepared, f.name) for f in dataclasses.fields(prepared)}
        return PreparedResponse(**fields, items=items, items_bytes=size)

    def _too_large(self, size: int) -> InvalidRequestError:
        return InvalidRequestError(
            f"This response's input items ({size} bytes as JSON, a continued conversation's "
            f"included) are more than this server stores for one response "
            f"({self.store.max_bytes} bytes, ingress.responses.max_mib); send the request "
            "with store: false (and the whole conversation as input).",
            param="store",
            code="invalid_value",
        )

    async def create(
        self,
        server: ChatAnswers,
        request: ResponsesRequest,
        prepared: PreparedResponse,
        timeout_s: float | None,
    ) -> Any:
        """The answer to a prepared request, through ``server``: a response (for
        ``background``, the one in progress), or its event stream (the server's
        ``StreamedChoices``). Nothing suspends before the request is submitted (the
        route's admission counted it)."""
        head = response_head(request, prepared.sampling, self.served_model_name)
        if request.background:
            return await self._start(server, head, prepared, timeout_s)
        keep = self._keeper(prepared) if prepared.items is not None else None
        if prepared.sampling.stream:
            return await server.respond(prepared, True, timeout_s, ResponseStream(head, keep))
        completion = await server.respond(prepared, True, timeout_s)
        response = build_response(head, completion)
        return keep(response) if keep is not None else response

    def _keeper(self, prepared: PreparedResponse) -> Callable[[ResponseObject], ResponseObject]:
        """What stores a response as it ends: it, or it with ``store`` false when it is
        larger than the store alone (its input fit; its output did not)."""
        items = prepared.items or []

        def keep(response: ResponseObject) -> ResponseObject:
            entry = StoredResponse(response.model_dump(mode="json"), items, prepared.items_bytes)
            if self.store.put(response.id, entry):
                return response
            logger.warning(
                "ingress: response %s (%d bytes) is larger than the response store "
                "(ingress.responses.max_mib); not stored",
                response.id,
                entry.size,
            )
            return response.model_copy(update={"store": False})

        return keep

    async def _start(
        self,
        server: ChatAnswers,
        head: ResponseObject,
        prepared: PreparedResponse,
        timeout_s: float | None,
    ) -> ResponseObject:
        """A background response: submitted, stored ``in_progress``, generated by a task."""
        tasks = await server.start(prepared, True, timeout_s)
        items = prepared.items or []
        entry = StoredResponse(head.model_dump(mode="json"), items, prepared.items_bytes)
        entry.choices = tasks
        if not self.store.put(head.id, entry):  # its input fit, with the head it does not
            for task in tasks:
                task.cancel()
            raise self._too_large(entry.size)
        entry.run = asyncio.create_task(self._run(server, head, prepared, entry))
        return head

    async def _run(
        self,
        server: ChatAnswers,
        head: ResponseObject,
        prepared: PreparedResponse,
        entry: StoredResponse,
    ) -> None:
        """A background response's generation, to its stored end (cancellation: `cancel`
        or `delete` records it)."""
        try:
            completion = await server.collect(prepared, entry.choices, True)
            response = build_response(head, completion)
        except Exception as exc:
            error = as_openai_error(exc)
            if not isinstance(exc, OpenAIError):
                logger.error("ingress: background response %s failed", head.id, exc_info=exc)
            response = failed(head, error.message)
        entry.choices = []  # ended
        self.store.set_response(head.id, response.model_dump(mode="json"))

    @staticmethod
    async def _stop(entry: StoredResponse) -> None:
        """Cancel a background generation and wait for it: its choices have ended, aborted
        on every model (cancelled here too: a task cancelled before it ran runs nothing)."""
        running = [task for task in (entry.run, *entry.choices) if task is not None]
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running)

    # ----------------------------------------------------------- stored responses
    def retrieve(self, response_id: str, query: Mapping[str, str]) -> dict[str, Any]:
        """``GET /v1/responses/{id}``: the stored response, as it is now."""
        if query.get("stream", "false").lower() not in ("false", "0"):
            raise InvalidRequestError(
                "Streaming a stored response again (stream=true) is not supported by this "
                "server; retrieve it without stream.",
                param="stream",
                code="unsupported_value",
            )
        return self._find(response_id).response

    async def delete(self, response_id: str) -> dict[str, Any]:
        """``DELETE /v1/responses/{id}``: OpenAI's deletion object; a background response
        still generating is cancelled first."""
        entry = self._find(response_id)
        if entry.running:
            await self._stop(entry)
        self.store.pop(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def cancel(self, response_id: str) -> dict[str, Any]:
        """``POST /v1/responses/{id}/cancel``: a background response in progress stops
        (aborted on every model) and is stored ``cancelled``; cancelling it again answers
        the same; any other is OpenAI's 400."""
        entry = self._find(response_id)
        status = entry.response["status"]
        if not entry.response.get("background"):
            raise InvalidRequestError("Cannot cancel a synchronous response.")
        if status == "cancelled":
            return entry.response
        if not entry.running:
            article = "an" if status[0] in "aeiou" else "a"
            raise InvalidRequestError(f"Cannot cancel {article} {status} response.")
        await self._stop(entry)
        response = cancelled(ResponseObject.model_validate(entry.response))
        entry_now = response.model_dump(mode="json")
        self.store.set_response(response_id, entry_now)
        return entry_now

    def input_items(self, response_id: str, query: Mapping[str, str]) -> dict[str, Any]:
        """``GET /v1/responses/{id}/input_items``: the items the response was made from (a
        continued conversation's included), OpenAI's cursor page (``after``, ``limit``
        1..100, default 20; ``order`` ``desc`` (default) or ``asc``)."""
        entry = self._find(response_id)
        raw_limit = query.get("limit", "20")
        if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= MAX_LIST_LIMIT:
            raise InvalidRequestError(
                f"'limit' must be an integer from 1 to {MAX_LIST_LIMIT} (got {raw_limit[:40]!r}).",
                param="limit",
                code="invalid_value",
            )
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise InvalidRequestError(
                f"'order' must be 'asc' or 'desc' (got {order[:40]!r}).",
                param="order",
                code="invalid_value",
            )
        items = entry.items if order == "asc" else entry.items[::-1]
        after = query.get("after")
        if after is not None:
            ids = [item.get("id") for item in items]
            if after not in ids:
                raise InvalidRequestError(
                    f"'after': no item {after[:80]!r} among this response's input items.",
                    param="after",
                    code="invalid_value",
                )
            items = items[ids.index(after) + 1 :]
        page = items[: int(raw_limit)]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > len(page),
        }

    def _find(self, response_id: str, param: str = "response_id") -> StoredResponse:
        """The stored response; 400 for an id that is not a response's, 404 for one not
        stored here (the message says why it may not be)."""
        if not response_id.startswith(RESPONSE_ID_PREFIX):
            raise InvalidRequestError(
                f"Invalid '{param}': {response_id[:80]!r}. Expected an ID that begins with "
                f"'{RESPONSE_ID_PREFIX.rstrip('_')}'.",
                param=param,
                code="invalid_value",
            )
        entry = self.store.get(response_id)
        if entry is not None:
            return entry
        where = (
            f" (this ingress replica's store: each of the {self.ingress_replicas} keeps its own)"
            if self.ingress_replicas > 1
            else ""
        )
        what = "Previous response" if param == "previous_response_id" else "Response"
        raise NotFoundError(
            f"{what} with id '{response_id[:80]}' not found{where}: it was created with store: "
            "false, deleted, or evicted (the store keeps the "
            f"{self.store.max_responses} most recently used responses, "
            f"{self.store.max_bytes / 2**20:g} MiB; ingress.responses).",
            param=param,
            code="previous_response_not_found" if param == "previous_response_id" else None,
        )

    async def stop(self) -> None:
        """Cancel the background responses still generating (the service stops)."""
        for entry in list(self.store.running()):
            await self._stop(entry)
