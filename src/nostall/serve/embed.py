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
(``Retry-After``); 503 shutting down, or out of device memory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr, ValidationError

from nostall.errors import (
    ArgumentError,
    CheckpointError,
    DeviceBusy,
    NostallError,
    QueueFull,
    ShuttingDown,
    UnknownModel,
)
from nostall.serve.budget import DeviceBudget, text_encoder_bytes
from nostall.serve.embed_cache import EmbeddingCache

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
    shape: _Shape | None = None  # read from its config files on first use


@dataclass(frozen=True)
class _Shape:
    """What a request may ask of an encoder, from its config files (nothing loaded)."""

    limit: int  # the longest max_length: its position embeddings, within the service's cap
    default: int  # the tokenizer's own length (CLIP's 77), within the limit
    layers: int  # hidden states: the embeddings', then one per layer
    positions: int | None  # absolute position embeddings (CLIP); None: relative (T5)


def _read_shape(enc: _Encoder, cap: int) -> _Shape:
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(enc.folder)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read the text encoder's config: {e}", path=enc.folder) from e
    positions = getattr(config, "max_position_embeddings", None)
    limit = min(cap, int(positions)) if positions else cap
    own = None
    try:
        with open(os.path.join(enc.tokenizer_folder, "tokenizer_config.json")) as f:
            own = json.load(f).get("model_max_length")
    except (OSError, ValueError, AttributeError):
        pass  # no tokenizer config: the limit is the default, as transformers' huge one is
    default = min(int(own), limit) if isinstance(own, (int, float)) and own >= 1 else limit
    return _Shape(limit, default, int(config.num_hidden_layers) + 1, positions)


@dataclass(eq=False)
class _Item:
    encoder: _Encoder
    key: tuple  # the cache's: (digest, SHA-256 of the text, max_length, hidden_layer, dtype)
    ids: torch.Tensor  # int64 (max_length,): the text's tokens, padded
    max_length: int
    hidden_layer: int | None
    future: Future
    arrived: float = 0.0


class _Body(BaseModel):
    """``POST /v1/embeddings``: strict types, so ``"77"``, ``77.9`` and ``true`` are not
    lengths; unknown fields are refused (a typo should not fall back to a default)."""

    model_config = ConfigDict(extra="forbid")

    encoder: StrictStr
    texts: list[StrictStr]
    max_length: StrictInt | None = None
    hidden_layer: StrictInt | None = None


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

    ``encoders``: the ``<pipeline>/<component>`` names to serve (default: every text
    encoder in the store, loaded on first use); ``dtype``: the encoders' dtype (default:
    as stored); ``max_length_cap``: the longest ``max_length`` a request may ask (an
    encoder with position embeddings allows no more than it has); ``max_texts``: texts
    per request; ``max_text_chars``: characters per text (default 8192, about four times
    what T5's 512 tokens cover in English; longer texts are refused); ``max_queue``:
    texts waiting to be encoded (more: :class:`~nostall.errors.QueueFull`); ``budget``:
    this process's device budget (:class:`~nostall.serve.budget.DeviceBudget`), from
    which the encoders' bytes are claimed at once (``encoder_bytes``).
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
        max_text_chars: int = 8192,
        max_queue: int = 1024,
        budget: DeviceBudget | None = None,
    ):
        from nostall.serve.metrics import EmbedMetrics
        from nostall.store.catalog import Store
        from nostall.transfer.loader import resolve_device

        self.device = resolve_device(device)
        self.dtype = dtype
        self.token_budget = token_budget
        self.max_wait_s = max_wait_s
        self.max_length_cap = max_length_cap
        self.max_texts = max_texts
        self.max_text_chars = max_text_chars
        self.max_queue = max_queue
        _check_options(self, cache_bytes)
        self.cache = EmbeddingCache(cache_bytes)
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
        max_length = self._check_lengths(encoder, enc, max_length, hidden_layer)
        self._load(enc)
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
            ids = self._tokenize(enc, misses, max_length)  # (N, max_length) int64
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
                raise QueueFull(
                    f"the embedding queue holds {waiting} texts of {self.max_queue}; "
                    f"{texts} more do not fit: retry in about {self.retry_after(texts)} s"
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

    def _check_lengths(self, name: str, enc: _Encoder, max_length: Any, hidden_layer: Any) -> int:
        """``max_length`` (its default for ``None``), checked with ``hidden_layer``
        against what ``enc`` can take, before it is loaded."""
        if enc.shape is None:
            enc.shape = _read_shape(enc, self.max_length_cap)
        shape = enc.shape
        if max_length is None:
            max_length = shape.default
        elif _not_int(max_length) or not 1 <= max_length <= shape.limit:
            why = (
                f"its {shape.positions} position embeddings"
                if shape.positions is not None and shape.positions <= self.max_length_cap
                else "the service's max_length_cap"
            )
            raise ArgumentError(
                f"max_length={max_length!r}: {name} takes 1..{shape.limit} tokens ({why})",
                field="max_length",
                allowed={"min": 1, "max": shape.limit},
            )
        if hidden_layer is not None:
            n = shape.layers
            if _not_int(hidden_layer) or not -n <= hidden_layer < n:
                raise ArgumentError(
                    f"hidden_layer={hidden_layer!r}: {name} has hidden states {-n}..{n - 1} "
                    "(-2: the one before the last, as SDXL and SD3 use)",
                    field="hidden_layer",
                    allowed={"min": -n, "max": n - 1},
                )
        return max_length

    def _tokenize(self, enc: _Encoder, texts: list[str], max_length: int) -> torch.Tensor:
        """The texts' tokens as diffusers' pipelines make them, truncated and padded to
        ``max_length``: int64 ``(N, max_length)``."""
        try:
            tokens = enc.tokenizer(
                texts,
                padding="max_length",
                max_length=max_length,
                truncation=True,
                return_length=False,
                return_overflowing_tokens=False,
                return_tensors="pt",
            )
        except (ValueError, TypeError) as e:
            raise ArgumentError(
                f"texts: the tokenizer of {enc.names[0]} refused them: {e}", field="texts"
            ) from e
        return tokens.input_ids

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


def _not_int(v: Any) -> bool:
    return isinstance(v, bool) or not isinstance(v, int)


def _check_options(service: EmbeddingService, cache_bytes: Any) -> None:
    s = service
    for name, v in (("cache_bytes", cache_bytes), ("token_budget", s.token_budget),
                    ("max_length_cap", s.max_length_cap), ("max_texts", s.max_texts),
                    ("max_text_chars", s.max_text_chars), ("max_queue", s.max_queue)):  # fmt: skip
        if _not_int(v) or v < (0 if name == "cache_bytes" else 1):
            raise ArgumentError(f"{name}={v!r}: give a whole number >= 1", field=name)
    if s.max_queue < s.max_texts:
        raise ArgumentError(
            f"max_queue={s.max_queue} < max_texts={s.max_texts}: a request of max_texts "
            "texts could never be queued; give max_queue >= max_texts",
            field="max_queue",
        )
    if not s.max_wait_s >= 0:
        raise ArgumentError(f"max_wait_s={s.max_wait_s!r}: give seconds >= 0", field="max_wait_s")


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


def create_embed_app(
    service: EmbeddingService,
    *,
    api_token: str | None = None,
    max_body_bytes: int | None = None,
    body_timeout: float | None = 120.0,
):
    """FastAPI app over ``service``: ``POST /v1/embeddings``, ``GET /v1/encoders``,
    ``/healthz``, ``/readyz``, ``/stats``, ``/metrics`` (Prometheus).

    ``api_token``: every path but the probes needs ``Authorization: Bearer <token>``
    (401 otherwise). ``max_body_bytes``: bodies beyond it are refused (413) from their
    ``Content-Length``, before a byte is read (default: what ``max_texts`` texts of
    ``max_text_chars`` characters take in JSON with every character escaped, plus 64 KiB).
    ``body_timeout``: seconds a body may take to arrive (408 after).
    """
    import asyncio
    import time
    from contextlib import asynccontextmanager

    from safetensors.torch import save

    from nostall.serve.budget import is_out_of_memory
    from nostall.serve.http import error_response, harden

    if max_body_bytes is None:
        max_body_bytes = service.max_texts * service.max_text_chars * 6 + (64 << 10)

    @asynccontextmanager
    async def lifespan(app):
        service.start()
        try:
            yield
        finally:
            await asyncio.to_thread(service.shutdown)

    app = FastAPI(title="nostall embeddings", lifespan=lifespan)
    error = error_response

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        t0 = time.perf_counter()
        encoder, response = await _embeddings(request)
        m = service.metrics
        m.requests.labels(encoder, str(response.status_code)).inc()
        m.latency.observe(time.perf_counter() - t0)
        return response

    async def _embeddings(request: Request) -> tuple[str, Response]:
        try:
            raw = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            return "-", error(400, "malformed_json", f"the body is not JSON: {e}")
        if isinstance(raw, dict) and isinstance(raw.get("texts"), str):
            raw["texts"] = [raw["texts"]]  # one text may be given bare
        try:
            body = _Body.model_validate(raw)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first["loc"]) or "body"
            got = repr(first.get("input"))
            got = got if len(got) <= 40 else got[:37] + "..."
            message = (
                f"{where}: {first['msg']} (got {got}); the body is {{encoder: string, "
                "texts: [string], max_length: integer?, hidden_layer: integer?}"
            )
            return "-", error(422, "invalid_value", message, field=where)
        # metrics label only the encoders there are: a client cannot make a series a name
        label = body.encoder if body.encoder in service.names() else "unknown"
        try:
            job = await asyncio.to_thread(
                service.submit, body.encoder, body.texts, body.max_length, body.hidden_layer
            )
            await asyncio.gather(*(asyncio.wrap_future(f) for f in job.futures))
            tensors, hits = job.result(0)
        except UnknownModel as e:
            return label, error(
                404, "unknown_encoder", str(e), encoder=e.name, encoders=e.available,
                close=e.close,
            )  # fmt: skip
        except ArgumentError as e:
            return label, error(
                422, "invalid_value", str(e), field=getattr(e, "field", None),
                allowed=getattr(e, "allowed", None),
            )  # fmt: skip
        except QueueFull as e:
            wait = service.retry_after(len(body.texts))
            return label, error(429, "queue_full", str(e), headers={"Retry-After": str(wait)})
        except DeviceBusy as e:
            wait = str(max(1, math.ceil(e.retry_after)))
            return label, error(503, "device_busy", str(e), headers={"Retry-After": wait})
        except NostallError as e:
            return label, error(503, type(e).__name__, str(e))
        except Exception as e:  # the batching thread survived it; say what happened
            if is_out_of_memory(e):  # a batch's activations did not fit: another may
                message = f"out of device memory while encoding: {e}"
                return label, error(503, "device_busy", message, headers={"Retry-After": "5"})
            return label, error(500, type(e).__name__, f"{type(e).__name__}: {e}")
        payload = save(
            {k: v.contiguous() for k, v in tensors.items()},
            metadata={"encoder": body.encoder},
        )
        return label, Response(
            payload,
            media_type="application/octet-stream",
            headers={"X-Nostall-Cache-Hits": str(hits), "X-Nostall-Texts": str(len(body.texts))},
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

    return harden(app, token=api_token, max_body=max_body_bytes, body_timeout=body_timeout)
