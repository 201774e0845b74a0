"""A client of the embedding service: timeouts, retries, safetensors on the wire."""

from __future__ import annotations

import json
import time

import torch

from nostall.errors import EmbeddingUnavailable, NostallError  # defined in the one tree

__all__ = ["EmbeddingClient", "EmbeddingUnavailable"]


class EmbeddingClient:
    """``EmbeddingClient("http://127.0.0.1:8001").encode("flux/text_encoder_2", ["a cat"], 512)``
    returns ``{"last_hidden_state": (N, L, D), "pooled": (N, D)?}`` on the CPU (with
    ``hidden_layer=k``, ``hidden_state``: the encoder's ``hidden_states[k]``).

    Connection errors, timeouts and 5xx answers are retried ``retries`` times with
    ``backoff`` seconds doubling in between, then raise :class:`EmbeddingUnavailable`;
    a 4xx answer (unknown encoder, bad value) raises at once."""

    def __init__(self, url: str, *, timeout: float = 10.0, retries: int = 2, backoff: float = 0.2):
        import httpx

        self.url = url.rstrip("/")
        self.retries = retries
        self.backoff = backoff
        self._http = httpx.Client(timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> EmbeddingClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def encode(
        self,
        encoder: str,
        texts: list[str],
        max_length: int | None = None,
        hidden_layer: int | None = None,
    ) -> dict[str, torch.Tensor]:
        """``max_length`` ``None``: the encoder's tokenizer's own."""
        import httpx
        from safetensors.torch import load

        req = {"encoder": encoder, "texts": texts}
        if max_length is not None:
            req["max_length"] = max_length
        if hidden_layer is not None:
            req["hidden_layer"] = hidden_layer
        body = json.dumps(req)
        wait = self.backoff
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            try:
                r = self._http.post(f"{self.url}/v1/embeddings", content=body)
            except httpx.HTTPError as e:
                last = e
            else:
                if r.status_code == 200:
                    return load(r.content)
                if r.status_code < 500:
                    message = r.json().get("error", {}).get("message", r.text)
                    raise NostallError(f"embedding service: {r.status_code} {message}")
                last = EmbeddingUnavailable(f"{r.status_code} {r.text[:200]}")
            if attempt < self.retries:
                time.sleep(wait)
                wait *= 2
        raise EmbeddingUnavailable(
            f"the embedding service at {self.url} did not answer after {self.retries + 1} "
            f"attempts: {last}"
        )
