"""The text-embedding service: unpooled (and pooled) text-encoder outputs over HTTP,
with dynamic batching and an exact-match cache (``nostall embed-server``).

Every FLUX/SD3 request needs T5-XXL (about 10 GB in bf16); one service can encode for
a fleet of workers, and the same prompt is encoded once. Encoders are named
``<pipeline>/<component>`` from a store of diffusers pipeline folders
(``flux/text_encoder_2``); components with the same bytes are one encoder (one module,
one cache), whatever pipeline names them.

Each text is tokenized as diffusers' pipelines do (``padding="max_length"``,
``truncation=True``, the given ``max_length``) and encoded; the answer holds
``last_hidden_state`` ``(N, L, D)`` (or, with ``hidden_layer`` ``k``, ``hidden_state``:
the encoder's ``hidden_states[k]``, which SDXL and SD3 take with ``k = -2``) and, for
encoders that pool (CLIP), ``pooled`` ``(N, D)``: ``pooler_output``, or ``text_embeds``
for CLIP with a projection. From these the worker puts together what FLUX's, SDXL's and
SD3's ``encode_prompt`` would (:mod:`nostall.serve.worker`).

**Batching.** A batch closes when its texts reach ``token_budget`` tokens (texts times
``max_length``) or ``max_wait_s`` after its first text arrived; one batch per encoder,
``max_length`` and ``hidden_layer``. A text encoded alone gives its pipeline's bits; in a batch of several,
the GEMMs differ in shape and the last bits of the embeddings may differ.

**Cache.** Exact match on (encoder digest, text, max length, hidden layer, dtype), least
recently used out first, within ``cache_bytes``.

**Wire.** ``POST /v1/embeddings`` with ``{"encoder", "texts": [...], "max_length",
"hidden_layer"}`` (the last two optional);
the answer is a safetensors file (never a pickle) with the tensors above, its
``X-Nostall-Cache-Hits`` header counting the texts served from the cache.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from nostall.errors import ArgumentError, NostallError, UnknownModel

__all__ = ["EmbeddingService", "create_embed_app"]

log = logging.getLogger(__name__)

_TOKENIZER = {"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2",
              "text_encoder_3": "tokenizer_3"}  # fmt: skip


@dataclass(eq=False)
class _Encoder:
    digest: str
    names: list[str]
    folder: str
    tokenizer_folder: str
    module: torch.nn.Module | None = None
    tokenizer: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(eq=False)
class _Item:
    encoder: _Encoder
    text: str
    max_length: int
    hidden_layer: int | None
    future: Future
    arrived: float


class _LRU:
    """Exact-match embeddings within a byte budget, least recently used out first."""

    def __init__(self, budget: int):
        self.budget = budget
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._d: OrderedDict[tuple, dict[str, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple) -> dict[str, torch.Tensor] | None:
        with self._lock:
            v = self._d.get(key)
            if v is None:
                self.misses += 1
                return None
            self._d.move_to_end(key)
            self.hits += 1
            return v

    def put(self, key: tuple, value: dict[str, torch.Tensor]) -> None:
        size = sum(t.numel() * t.element_size() for t in value.values())
        if size > self.budget:
            return
        with self._lock:
            old = self._d.pop(key, None)
            if old is not None:
                self.bytes -= sum(t.numel() * t.element_size() for t in old.values())
            self._d[key] = value
            self.bytes += size
            while self.bytes > self.budget:
                _, out = self._d.popitem(last=False)
                self.bytes -= sum(t.numel() * t.element_size() for t in out.values())

    def __len__(self) -> int:
        return len(self._d)


class EmbeddingService:
    """Text encoders of a store, a batching thread and the cache.

    ``models``: a :class:`~nostall.cache.Store`, or a folder or mapping whose store this
    process shares (:meth:`Store.shared <nostall.cache.Store.shared>`).

    ``encoders``: the ``<pipeline>/<component>`` names to serve (default: every text
    encoder in the store, loaded on first use); ``dtype``: the encoders' dtype (default:
    as stored); ``max_length_cap``: the longest ``max_length`` a request may ask.
    """

    def __init__(
        self,
        models: Any,
        *,
        device: str | torch.device = "cuda",
        dtype: torch.dtype | None = None,
        cache_bytes: int = 1 << 30,
        token_budget: int = 8192,
        max_wait_s: float = 0.005,
        max_length_cap: int = 1024,
        max_texts: int = 256,
    ):
        from nostall.cache.store import Store
        from nostall.serve.metrics import EmbedMetrics
        from nostall.transfer.loader import resolve_device

        self.device = resolve_device(device)
        self.dtype = dtype
        self.token_budget = token_budget
        self.max_wait_s = max_wait_s
        self.max_length_cap = max_length_cap
        self.max_texts = max_texts
        self.cache = _LRU(cache_bytes)
        self.metrics = EmbedMetrics()
        self.store = Store.shared(models)  # a worker in this process reads the same one
        self._by_name: dict[str, _Encoder] = {}
        by_digest: dict[str, _Encoder] = {}
        for pname in self.store.names():
            entry = self.store.entry(pname)
            for role, c in entry.components.items():
                if c is None or role not in _TOKENIZER or not c.weights:
                    continue
                tok = os.path.join(entry.folder, _TOKENIZER[role])
                enc = by_digest.get(c.digest)
                if enc is None:
                    enc = by_digest[c.digest] = _Encoder(c.digest, [], c.folder, tok)
                enc.names.append(f"{pname}/{role}")
                self._by_name[f"{pname}/{role}"] = enc
        self._queue: list[_Item] = []
        self._cond = threading.Condition()
        self._accepting = False
        self._thread: threading.Thread | None = None
        self.batches = 0
        self.batched_texts = 0

    def names(self) -> list[str]:
        return sorted(self._by_name)

    # ---- lifecycle -------------------------------------------------------------------

    def start(self) -> EmbeddingService:
        if self._thread is None:
            self._accepting = True
            self._thread = threading.Thread(target=self._run, name="nostall-embed", daemon=True)
            self._thread.start()
        return self

    def shutdown(self, timeout: float = 60.0) -> None:
        with self._cond:
            self._accepting = False
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def ready(self) -> bool:
        return self._accepting and self._thread is not None and self._thread.is_alive()

    # ---- requests ----------------------------------------------------------------------

    def encode(
        self,
        encoder: str,
        texts: list[str],
        max_length: int | None = None,
        hidden_layer: int | None = None,
    ) -> tuple[dict, int]:
        """Embeddings of ``texts`` (stacked) and how many came from the cache; blocks.
        ``max_length`` ``None``: the tokenizer's own (CLIP's 77), as pipelines use it;
        ``hidden_layer`` ``None``: ``last_hidden_state``, else ``hidden_states[k]``."""
        enc = self._by_name.get(encoder)
        if enc is None:
            import difflib

            raise UnknownModel(
                f"no text encoder {encoder!r}; the store has {self.names()}",
                name=encoder,
                available=self.names(),
                close=difflib.get_close_matches(encoder, self.names()),
            )
        if not texts or len(texts) > self.max_texts:
            raise ArgumentError(f"texts: give 1 to {self.max_texts}, got {len(texts)}")
        self._load(enc)
        if max_length is None:
            max_length = min(int(enc.tokenizer.model_max_length), self.max_length_cap)
        if isinstance(max_length, bool) or not 1 <= max_length <= self.max_length_cap:
            raise ArgumentError(f"max_length={max_length}: must be in [1, {self.max_length_cap}]")
        if hidden_layer is not None:
            layers = int(enc.module.config.num_hidden_layers) + 1  # the embeddings, then each
            if isinstance(hidden_layer, bool) or not -layers <= hidden_layer < layers:
                raise ArgumentError(
                    f"hidden_layer={hidden_layer}: {encoder} has hidden states "
                    f"{-layers}..{layers - 1} (-2: the one before the last, as SDXL and SD3 use)"
                )
        dtype = str(next(enc.module.parameters()).dtype)
        parts: list[Any] = []
        hits = 0
        pending = []
        for text in texts:
            if not isinstance(text, str):
                raise ArgumentError(
                    f"texts: every text must be a string, got {type(text).__name__}"
                )
            got = self.cache.get((enc.digest, text, max_length, hidden_layer, dtype))
            if got is not None:
                hits += 1
                parts.append(got)
            else:
                item = _Item(enc, text, max_length, hidden_layer, Future(), time.perf_counter())
                parts.append(item)
                pending.append(item)
        self.metrics.texts.labels("cache").inc(hits)
        if pending:
            self.metrics.texts.labels("encoded").inc(len(pending))
            with self._cond:
                if not self._accepting:
                    raise NostallError("the embedding service is shutting down")
                self._queue.extend(pending)
                self.metrics.queue_depth.set(len(self._queue))
                self._cond.notify_all()
        out = [p.future.result(timeout=600) if isinstance(p, _Item) else p for p in parts]
        return {k: torch.stack([o[k] for o in out]) for k in out[0]}, hits

    def _load(self, enc: _Encoder) -> None:
        if enc.module is not None:
            return
        with enc.lock:
            if enc.module is None:
                import transformers

                import nostall

                enc.tokenizer = transformers.AutoTokenizer.from_pretrained(enc.tokenizer_folder)
                enc.module = nostall.load_model(enc.folder, device=self.device, dtype=self.dtype)
                enc.module.eval()
                log.info("loaded text encoder %s on %s", ", ".join(enc.names), self.device)

    # ---- the batching thread --------------------------------------------------------------

    def _take_batch(self) -> list[_Item] | None:
        with self._cond:
            while True:
                if not self._queue:
                    if not self._accepting:
                        return None
                    self._cond.wait()
                    continue
                first = self._queue[0]
                same = [
                    i for i in self._queue
                    if i.encoder is first.encoder and i.max_length == first.max_length
                    and i.hidden_layer == first.hidden_layer
                ]  # fmt: skip
                full = len(same) * first.max_length >= self.token_budget
                late = time.perf_counter() - first.arrived >= self.max_wait_s
                if full or late or not self._accepting:
                    per = max(1, self.token_budget // first.max_length)
                    batch = same[:per]
                    taken = {id(i) for i in batch}
                    self._queue = [i for i in self._queue if id(i) not in taken]
                    self.metrics.queue_depth.set(len(self._queue))
                    return batch
                self._cond.wait(self.max_wait_s - (time.perf_counter() - first.arrived))

    def _run(self) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            t = time.perf_counter()
            try:
                outs = self._encode_batch(batch)
                self.metrics.batch_seconds.observe(time.perf_counter() - t)
                self.metrics.batch_texts.observe(len(batch))
            except BaseException as e:  # the batch fails; the thread carries on
                log.exception("encoding a batch of %d failed", len(batch))
                for item in batch:
                    item.future.set_exception(e)
                continue
            for item, out in zip(batch, outs, strict=True):
                dtype = str(next(item.encoder.module.parameters()).dtype)
                key = (item.encoder.digest, item.text, item.max_length, item.hidden_layer, dtype)
                self.cache.put(key, out)
                item.future.set_result(out)
            self.metrics.cache_bytes.set(self.cache.bytes)

    def _encode_batch(self, batch: list[_Item]) -> list[dict[str, torch.Tensor]]:
        enc = batch[0].encoder
        tokens = enc.tokenizer(
            [i.text for i in batch],
            padding="max_length",
            max_length=batch[0].max_length,
            truncation=True,
            return_length=False,
            return_overflowing_tokens=False,
            return_tensors="pt",
        )
        layer = batch[0].hidden_layer
        with torch.inference_mode():
            out = enc.module(
                tokens.input_ids.to(self.device), output_hidden_states=layer is not None
            )
        dtype = next(enc.module.parameters()).dtype
        if layer is None:
            fields = {"last_hidden_state": out.last_hidden_state.to(dtype)}
        else:
            fields = {"hidden_state": out.hidden_states[layer].to(dtype)}
        pooled = getattr(out, "pooler_output", None)
        if pooled is None:
            pooled = getattr(out, "text_embeds", None)
        if pooled is not None:
            fields["pooled"] = pooled.to(dtype)
        self.batches += 1
        self.batched_texts += len(batch)
        # one device-to-host copy per output, then each text its own row (a clone, so a
        # cached text does not keep its whole batch alive)
        host = {k: v.detach().cpu() for k, v in fields.items()}
        return [{k: v[i].clone() for k, v in host.items()} for i in range(len(batch))]

    def stats(self) -> dict[str, Any]:
        return {
            "encoders": {n: e.module is not None for n, e in sorted(self._by_name.items())},
            "cache": {
                "entries": len(self.cache),
                "bytes": self.cache.bytes,
                "budget": self.cache.budget,
                "hits": self.cache.hits,
                "misses": self.cache.misses,
            },
            "batches": self.batches,
            "texts_encoded": self.batched_texts,
        }


def create_embed_app(service: EmbeddingService):
    """FastAPI app over ``service``: ``POST /v1/embeddings``, ``GET /v1/encoders``,
    ``/healthz``, ``/readyz``, ``/stats``, ``/metrics`` (Prometheus)."""
    import asyncio
    import json
    import time
    from contextlib import asynccontextmanager

    from safetensors.torch import save

    @asynccontextmanager
    async def lifespan(app):
        service.start()
        try:
            yield
        finally:
            await asyncio.to_thread(service.shutdown)

    app = FastAPI(title="nostall embeddings", lifespan=lifespan)

    def error(status: int, kind: str, message: str, **extra) -> JSONResponse:
        return JSONResponse({"error": {"type": kind, "message": message, **extra}}, status)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        t0 = time.perf_counter()
        encoder, response = await _embeddings(request)
        m = service.metrics
        m.requests.labels(encoder, str(response.status_code)).inc()
        m.latency.observe(time.perf_counter() - t0)
        return response

    async def _embeddings(request: Request) -> tuple[str, Response]:
        encoder = "-"
        try:
            body = json.loads(await request.body())
            encoder, texts = body["encoder"], body["texts"]
            max_length = body.get("max_length")
            max_length = None if max_length is None else int(max_length)
            layer = body.get("hidden_layer")
            layer = None if layer is None else int(layer)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            message = f"expected {{encoder, texts, max_length, hidden_layer}}: {e}"
            return encoder, error(400, "malformed_body", message)
        encoder = str(encoder) if encoder in service.names() else "unknown"
        if isinstance(texts, str):
            texts = [texts]
        try:
            tensors, hits = await asyncio.to_thread(
                service.encode, encoder, texts, max_length, layer
            )
        except UnknownModel as e:
            return encoder, error(404, "unknown_encoder", str(e), encoders=service.names())
        except ArgumentError as e:
            return encoder, error(422, "invalid_value", str(e))
        except NostallError as e:
            return encoder, error(503, type(e).__name__, str(e))
        payload = save(
            {k: v.contiguous() for k, v in tensors.items()},
            metadata={"encoder": encoder},
        )
        return encoder, Response(
            payload,
            media_type="application/octet-stream",
            headers={"X-Nostall-Cache-Hits": str(hits), "X-Nostall-Texts": str(len(texts))},
        )

    @app.get("/v1/encoders")
    async def encoders() -> dict:
        return {"encoders": service.names()}

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> Response:
        return JSONResponse({"ready": service.ready}, 200 if service.ready else 503)

    @app.get("/stats")
    async def stats() -> dict:
        return service.stats()

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
