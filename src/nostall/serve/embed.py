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

**Batching.** A request's texts are tokenized in the request's own thread (truncated to
``max_length`` tokens); the batching thread only runs encoders, so a request of long texts
holds up no other. A batch closes when its texts reach ``token_budget`` tokens (texts
times ``max_length``) or ``max_wait_s`` after its first text arrived; one batch per
encoder, ``max_length`` and ``hidden_layer``. A text encoded alone gives its pipeline's
bits; in a batch of several, the GEMMs differ in shape and the last bits may differ.

**Limits.** A request is checked against its encoder before anything is loaded:
``max_length`` at most the encoder's position embeddings (CLIP's 77; T5's relative
positions take any length) and ``max_length_cap``; ``hidden_layer`` within its hidden
states. A text longer than ``max_text_chars`` characters is refused, not cut: cutting
characters could change the tokens the pipeline's own encode gives, and tokenizing 200k
characters takes seconds. At most ``max_queue`` texts wait to be encoded; a request that
would pass that is refused (:class:`~nostall.errors.QueueFull`), with a wait estimated
from the recent texts per second (:meth:`EmbeddingService.retry_after`).

**Cache.** Exact match on (encoder digest, SHA-256 of the text, max length, hidden layer,
dtype), least recently used out first. ``cache_bytes`` bounds keys and values alike (the
tensors' bytes and the objects around them), so unique long texts cannot grow it past
its budget.

**Wire.** ``POST /v1/embeddings`` with ``{"encoder", "texts": [...], "max_length",
"hidden_layer"}`` (the last two optional and integers: ``"77"``, ``77.0`` and ``true`` are
refused); the answer is a safetensors file (never a pickle) with the tensors above, its
``X-Nostall-Cache-Hits`` header counting the texts served from the cache. Errors are
JSON ``{"error": {"type", "message", ...}}``: 400 not JSON; 401 without the token
(``api_token``); 404 an unknown encoder (named, with the encoders there are); 413 a body
over ``max_body_bytes`` (refused before it is read); 422 a value out of range, or an
encoder's ``ValueError`` (``field`` and ``allowed`` name what); 429 the queue is full
(``Retry-After``); 503 shutting down, or out of device memory: the worker's mapping
(:func:`~nostall.serve.answers.error_answer`). The HTTP routes are
:mod:`nostall.serve.embed_app`'s; the encoders themselves :mod:`nostall.serve.encoders`'.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from nostall.cache.config import resolve_config
from nostall.errors import ArgumentError, QueueFull, ShuttingDown, UnknownModel
from nostall.serve.budget import DeviceBudget, text_encoder_bytes
from nostall.serve.config import EmbedConfig
from nostall.serve.embed_app import create_embed_app
from nostall.serve.embed_cache import EmbeddingCache
from nostall.serve.encoders import Encoder, encoders_of

__all__ = ["EmbedConfig", "EmbeddingService", "Embeddings", "create_embed_app"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Item:
    encoder: Encoder
    key: tuple  # the cache's: (digest, SHA-256 of the text, max_length, hidden_layer, dtype)
    ids: torch.Tensor  # int64 (max_length,): the text's tokens, padded
    max_length: int
    hidden_layer: int | None
    future: Future
    arrived: float = 0.0


class _Rate:
    """Texts per second of encoding over the last ``window`` batches (the time a full
    queue takes to drain, for ``Retry-After``)."""

    def __init__(self, window: int = 32):
        self._batches: deque[tuple[int, float]] = deque(maxlen=window)
        self._lock = threading.Lock()

    def add(self, texts: int, seconds: float) -> None:
        with self._lock:
            self._batches.append((texts, seconds))

    def texts_per_s(self) -> float | None:
        with self._lock:
            seconds = sum(s for _, s in self._batches)
            return sum(n for n, _ in self._batches) / seconds if seconds > 0 else None


class EmbeddingService:
    """Text encoders of a store, a batching thread and the cache.

    ``models``: a :class:`~nostall.cache.Store`, or a folder or mapping whose store this
    process shares (:meth:`Store.shared <nostall.cache.Store.shared>`).

    ``config``: how it runs (:class:`~nostall.serve.config.EmbedConfig`: device, dtype,
    the cache's bytes, batching, the request limits); or give its fields as keyword
    arguments, not both. Every text encoder of the store is served, loaded on first
    use. ``budget``: this process's device budget
    (:class:`~nostall.serve.budget.DeviceBudget`), from which the encoders' bytes are
    claimed at once (``encoder_bytes``).
    """

    def __init__(
        self,
        models: Any,
        *,
        config: EmbedConfig | None = None,
        budget: DeviceBudget | None = None,
        **options: Any,
    ):
        from nostall.serve.metrics import EmbedMetrics
        from nostall.store.catalog import Store
        from nostall.transfer.loader import resolve_device

        config = resolve_config(EmbedConfig, config, options, "EmbeddingService")
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = dtype = config.dtype
        self.token_budget = config.token_budget
        self.max_wait_s = config.max_wait_s
        self.max_length_cap = config.max_length_cap
        self.max_texts = config.max_texts
        self.max_text_chars = config.max_text_chars
        self.max_queue = config.max_queue
        self.cache = EmbeddingCache(config.cache_bytes)
        self.metrics = EmbedMetrics()
        self.store = Store.shared(models)  # a worker in this process reads the same one
        self._by_name: dict[str, Encoder] = encoders_of(self.store)
        # Every encoder on the device, once each has been asked for: claimed now, so a
        # worker sharing the budget sizes its cache around them (loading T5 later finds
        # its room).
        self.encoder_bytes = text_encoder_bytes(self.store, dtype)
        if budget is not None:
            if budget.device != self.device:
                raise ArgumentError(
                    f"the budget is {budget.device}'s and the service runs on {self.device}; "
                    "give it the budget of its own device"
                )
            budget.claim("embedding service", self.encoder_bytes)
        self._budget, self._claimed = budget, budget is not None
        self._queue: list[_Item] = []
        self._cond = threading.Condition()
        self._accepting = False
        self._thread: threading.Thread | None = None
        self.batches = 0
        self.batched_texts = 0
        self._rate = _Rate()

    def names(self) -> list[str]:
        return sorted(self._by_name)

    # ---- lifecycle -------------------------------------------------------------------

    def start(self) -> EmbeddingService:
        if self._budget is not None and not self._claimed:  # started again after a shutdown
            self._budget.claim("embedding service", self.encoder_bytes)
            self._claimed = True
        if self._thread is None:
            self._accepting = True
            self._thread = threading.Thread(target=self._run, name="nostall-embed", daemon=True)
            self._thread.start()
        return self

    def shutdown(self, timeout: float = 60.0) -> None:
        """Take no more texts, let the batch under way finish, then give back the
        encoders' device memory, the cached embeddings and the budget's claim (a
        worker started after it in this process finds them free)."""
        with self._cond:
            self._accepting = False
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the embedding batch under way did not finish within %.0f s", timeout)
                return  # its encoders are in use: kept
            self._thread = None
        for enc in {id(e): e for e in self._by_name.values()}.values():
            with enc.lock:
                enc.module = None
        self.cache.clear()
        if self._claimed:
            self._budget.release("embedding service")
            self._claimed = False

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
        ``hidden_layer`` ``None``: ``last_hidden_state``, else ``hidden_states[k]``.
        Raises :class:`~nostall.errors.UnknownModel`, :class:`~nostall.ArgumentError`
        (a value out of range, an encoder's ``ValueError``), ``QueueFull``, ``ShuttingDown``.
        """
        return self.submit(encoder, texts, max_length, hidden_layer).result(timeout=600)

    def submit(
        self,
        encoder: str,
        texts: list[str],
        max_length: int | None = None,
        hidden_layer: int | None = None,
    ) -> Embeddings:
        """:meth:`encode` without the wait: the request checked, tokenized (in the
        caller's thread) and queued; the answer's :meth:`Embeddings.result` waits."""
        enc = self._by_name.get(encoder)
        if enc is None:
            import difflib

            raise UnknownModel(
                f"no text encoder {encoder!r}; the store has {self.names()}",
                name=encoder,
                available=self.names(),
                close=difflib.get_close_matches(encoder, self.names()),
            )
        hashes = self._check_texts(texts)
        max_length = enc.check(encoder, max_length, hidden_layer, self.max_length_cap)
        enc.load(self.device, self.dtype)
        dtype = str(next(enc.module.parameters()).dtype)
        parts: list[Any] = []
        hits = 0
        pending: list[_Item] = []
        misses: list[str] = []
        for text, digest in zip(texts, hashes, strict=True):
            key = (enc.digest, digest, max_length, hidden_layer, dtype)
            got = self.cache.get(key)
            if got is not None:
                hits += 1
                parts.append(got)
            else:
                item = _Item(enc, key, _NO_IDS, max_length, hidden_layer, Future())
                parts.append(item)
                pending.append(item)
                misses.append(text)
        if pending:
            self._admit(len(pending))  # before the tokenizer's work, and again after it
            ids = enc.tokenize(misses, max_length)  # (N, max_length) int64
            for i, item in enumerate(pending):
                item.ids = ids[i]
            with self._cond:
                self._admit(len(pending))
                now = time.perf_counter()
                for item in pending:
                    item.arrived = now
                self._queue.extend(pending)
                self.metrics.queue_depth.set(len(self._queue))
                self._cond.notify_all()
        self.metrics.texts.labels("cache").inc(hits)
        self.metrics.texts.labels("encoded").inc(len(pending))
        return Embeddings(parts, hits)

    def retry_after(self, texts: int = 1) -> int:
        """Seconds (1..60) until the queue has room for ``texts`` more, at the texts per
        second of the recent batches (1 before the first batch)."""
        with self._cond:
            excess = len(self._queue) + texts - self.max_queue
        rate = self._rate.texts_per_s()
        if rate is None or excess <= 0:
            return 1
        return max(1, min(60, math.ceil(excess / rate)))

    def _admit(self, texts: int) -> None:
        with self._cond:  # re-entrant: a Condition's lock is an RLock
            if not self._accepting:
                raise ShuttingDown("the embedding service is shutting down; retry elsewhere")
            waiting = len(self._queue)
            if waiting + texts > self.max_queue:
                wait = self.retry_after(texts)
                raise QueueFull(
                    f"the embedding queue holds {waiting} texts of {self.max_queue}; "
                    f"{texts} more do not fit: retry in about {wait} s",
                    retry_after=wait,
                )

    def _check_texts(self, texts: Any) -> list[bytes]:
        """SHA-256 of each text, the cache's key for it (a digest, not the text: a key's
        size does not grow with the text)."""
        if not isinstance(texts, list) or not 1 <= len(texts) <= self.max_texts:
            n = len(texts) if isinstance(texts, list) else type(texts).__name__
            raise ArgumentError(
                f"texts: give a list of 1 to {self.max_texts} strings, got {n}",
                field="texts",
                allowed=f"1..{self.max_texts} strings",
            )
        out = []
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise ArgumentError(
                    f"texts[{i}]: every text must be a string, got {type(text).__name__}",
                    field="texts",
                )
            if len(text) > self.max_text_chars:
                raise ArgumentError(
                    f"texts[{i}]: {len(text)} characters; the service takes at most "
                    f"{self.max_text_chars} (max_text_chars): shorten it, or encode it "
                    "locally",
                    field="texts",
                    allowed=f"at most {self.max_text_chars} characters",
                )
            try:
                raw = text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ArgumentError(
                    f"texts[{i}]: not valid Unicode (a lone surrogate at {e.start})",
                    field="texts",
                ) from e
            out.append(hashlib.sha256(raw).digest())
        return out

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
                same = [i for i in self._queue if _alike(i, first)]
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
        while (batch := self._take_batch()) is not None:
            self._serve(batch)

    def _serve(self, batch: list[_Item]) -> None:
        t = time.perf_counter()
        try:
            outs = self._encode_batch(batch)
        except ValueError as e:
            if len(batch) > 1:  # one text at fault must not fail those batched with it
                for item in batch:
                    self._serve([item])
                return
            refused = ArgumentError(
                f"{batch[0].encoder.names[0]} refused the text: {e}", field="texts"
            )
            refused.__cause__ = e
            log.info("%s", refused)
            batch[0].future.set_exception(refused)
            return
        except BaseException as e:  # the batch fails; the thread carries on
            log.exception("encoding a batch of %d failed", len(batch))
            for item in batch:
                item.future.set_exception(e)
            return
        seconds = time.perf_counter() - t
        self._rate.add(len(batch), seconds)
        self.metrics.batch_seconds.observe(seconds)
        self.metrics.batch_texts.observe(len(batch))
        for item, out in zip(batch, outs, strict=True):
            self.cache.put(item.key, out)
            item.future.set_result(out)
        self.metrics.cache_bytes.set(self.cache.bytes)

    def _encode_batch(self, batch: list[_Item]) -> list[dict[str, torch.Tensor]]:
        enc = batch[0].encoder
        ids = torch.stack([i.ids for i in batch])  # (N, L) int64, tokenized by submit
        layer = batch[0].hidden_layer
        with torch.inference_mode():
            out = enc.module(ids.to(self.device), output_hidden_states=layer is not None)
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
            "queue": {"texts": len(self._queue), "max": self.max_queue},
            "texts_per_s": self._rate.texts_per_s(),
        }


_NO_IDS = torch.empty(0, dtype=torch.int64)  # an item's tokens until submit has them


def _alike(a: _Item, b: _Item) -> bool:
    """Whether ``a`` and ``b`` may share a batch: one encoder, length and layer."""
    return (
        a.encoder is b.encoder and a.max_length == b.max_length and a.hidden_layer == b.hidden_layer
    )


class Embeddings:
    """One request's answer to come: :meth:`result` waits for its texts (those from the
    cache are already there)."""

    def __init__(self, parts: list[Any], hits: int):
        self._parts = parts
        self.hits = hits
        self.futures = [p.future for p in parts if isinstance(p, _Item)]

    def result(self, timeout: float | None = None) -> tuple[dict[str, torch.Tensor], int]:
        """The texts' tensors stacked (``(N, ...)``) and how many came from the cache;
        raises what encoding raised."""
        out = [p.future.result(timeout) if isinstance(p, _Item) else p for p in self._parts]
        return {k: torch.stack([o[k] for o in out]) for k in out[0]}, self.hits
