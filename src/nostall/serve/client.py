"""A client of the embedding service: timeouts, retries, safetensors on the wire, and
every reply checked before it is used."""

from __future__ import annotations

import json
import os
import time

import torch

from nostall.errors import EmbeddingUnavailable  # defined in the one tree

__all__ = ["EmbeddingClient", "EmbeddingUnavailable"]


class EmbeddingClient:
    """``EmbeddingClient("http://127.0.0.1:8001").encode("flux/text_encoder_2", ["a cat"], 512)``
    returns ``{"last_hidden_state": (N, L, D), "pooled": (N, D)?}`` on the CPU (with
    ``hidden_layer=k``, ``hidden_state``: the encoder's ``hidden_states[k]``).

    Every failure is an :class:`EmbeddingUnavailable` naming the service and the fault, so
    a caller that can encode locally (the worker) catches one type:

    - connection errors, timeouts and 5xx answers are retried ``retries`` times with
      ``backoff`` seconds doubling in between;
    - a 4xx answer (unknown encoder, bad value) and a 429 (the service's queue is full:
      encoding locally beats waiting in line) fail at once, with the service's message;
    - a 200 whose body is not a safetensors file, or whose tensors are missing, of another
      rank, row count or length than asked, or not floating point, fails at once: a reply
      that came whole and wrong would come back the same.

    ``token``: sent as ``Authorization: Bearer``; default: ``$NOSTALL_API_TOKEN``, the
    token ``nostall embed-server`` (and ``serve``) read, so one variable configures both
    ends.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 10.0,
        retries: int = 2,
        backoff: float = 0.2,
        token: str | None = None,
    ):
        import httpx

        self.url = url.rstrip("/")
        self.retries = retries
        self.backoff = backoff
        token = token if token is not None else os.environ.get("NOSTALL_API_TOKEN") or None
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(timeout=timeout, headers=headers)

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

        req = {"encoder": encoder, "texts": texts}
        if max_length is not None:
            req["max_length"] = max_length
        if hidden_layer is not None:
            req["hidden_layer"] = hidden_layer
        body = json.dumps(req)
        wait = self.backoff
        last: Exception | str | None = None
        for attempt in range(self.retries + 1):
            try:
                r = self._http.post(f"{self.url}/v1/embeddings", content=body)
            except httpx.HTTPError as e:  # includes a body cut short of its Content-Length
                last = e
            else:
                if r.status_code == 200:
                    return self._check(r.content, len(texts), max_length, hidden_layer)
                if r.status_code < 500:
                    said = _message(r)
                    if r.status_code == 429 and "retry-after" in r.headers:
                        said += f" (Retry-After {r.headers['retry-after']} s)"
                    raise EmbeddingUnavailable(
                        f"the embedding service at {self.url} refused {encoder!r}: "
                        f"{r.status_code} {said}"
                    )
                last = f"{r.status_code} {_message(r)}"
            if attempt < self.retries:
                time.sleep(wait)
                wait *= 2
        raise EmbeddingUnavailable(
            f"the embedding service at {self.url} did not answer after {self.retries + 1} "
            f"attempts: {last}"
        )

    def _check(
        self, content: bytes, n: int, max_length: int | None, hidden_layer: int | None
    ) -> dict[str, torch.Tensor]:
        """The tensors of a 200 reply, or :class:`EmbeddingUnavailable` saying what is wrong
        with it: what reaches a pipeline has the rows, length and dtype asked for."""
        from safetensors.torch import load

        def bad(what: str) -> EmbeddingUnavailable:
            return EmbeddingUnavailable(
                f"the embedding service at {self.url} answered 200 with {what}; "
                "check that the URL is a nostall embed-server of the same version"
            )

        try:
            out = load(content)
        except Exception as e:  # SafetensorError and whatever a malformed header raises
            raise bad(f"a body that is not a safetensors file ({len(content)} bytes: {e})") from e
        name = "last_hidden_state" if hidden_layer is None else "hidden_state"
        state = out.get(name)
        if state is None:
            raise bad(f"no {name!r} tensor (it holds {sorted(out)})")
        want = f"({n}, {max_length if max_length is not None else 'L'}, D)"
        for key, t, rank in ((name, state, 3), ("pooled", out.get("pooled"), 2)):
            if t is None:
                continue
            if t.dim() != rank or t.shape[0] != n or (rank == 3 and t.shape[1] == 0):
                raise bad(f"{key} of shape {tuple(t.shape)} for {n} texts; expected {want}")
            if not t.dtype.is_floating_point:
                raise bad(f"{key} of dtype {str(t.dtype).removeprefix('torch.')}")
        if max_length is not None and state.shape[1] != max_length:
            raise bad(f"{name} of shape {tuple(state.shape)}; expected {want}")
        return out


def _message(r) -> str:
    """The service's ``error.message``, or the start of whatever else the body is (a
    proxy's HTML page)."""
    try:
        message = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return r.text[:200]
    return str(message)
