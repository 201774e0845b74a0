"""The text encoders of a store, as the embedding service serves them: one
:class:`Encoder` per distinct component (components with the same bytes are one encoder,
whatever pipeline names them), what a request may ask of it read from its config files
before anything is loaded (:class:`Shape`), its tokenizer used as diffusers' pipelines
use it, its module loaded on first use."""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from nostall.errors import ArgumentError, CheckpointError

__all__ = ["TOKENIZERS", "Encoder", "Shape", "encoders_of"]

log = logging.getLogger("nostall.serve.embed")

#: The tokenizer folder of each text encoder role of a diffusers pipeline.
TOKENIZERS = {
    "text_encoder": "tokenizer",
    "text_encoder_2": "tokenizer_2",
    "text_encoder_3": "tokenizer_3",
}


@dataclass(frozen=True)
class Shape:
    """What a request may ask of an encoder, from its config files (nothing loaded)."""

    limit: int  # the longest max_length: its position embeddings, within the service's cap
    default: int  # the tokenizer's own length (CLIP's 77), within the limit
    layers: int  # hidden states: the embeddings', then one per layer
    positions: int | None  # absolute position embeddings (CLIP); None: relative (T5)


@dataclass(eq=False)
class Encoder:
    """One text encoder of the store: its digest, the ``<pipeline>/<role>`` names it is
    asked by, its folders; ``module`` and ``tokenizer`` once :meth:`load` ran (under
    ``lock``), ``shape`` once :meth:`check` first read it."""

    digest: str
    names: list[str]
    folder: str
    tokenizer_folder: str
    module: torch.nn.Module | None = None
    tokenizer: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    shape: Shape | None = None  # read from its config files on first use

    def check(self, name: str, max_length: Any, hidden_layer: Any, cap: int) -> int:
        """``max_length`` (its default for ``None``), checked with ``hidden_layer``
        against what this encoder can take, before it is loaded (``cap``: the
        service's ``max_length_cap``)."""
        if self.shape is None:
            self.shape = _read_shape(self, cap)
        shape = self.shape
        if max_length is None:
            max_length = shape.default
        elif _not_int(max_length) or not 1 <= max_length <= shape.limit:
            why = (
                f"its {shape.positions} position embeddings"
                if shape.positions is not None and shape.positions <= cap
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

    def tokenize(self, texts: list[str], max_length: int) -> torch.Tensor:
        """The texts' tokens as diffusers' pipelines make them, truncated and padded to
        ``max_length``: int64 ``(N, max_length)``."""
        try:
            tokens = self.tokenizer(
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
                f"texts: the tokenizer of {self.names[0]} refused them: {e}", field="texts"
            ) from e
        return tokens.input_ids

    def load(self, device: torch.device, dtype: torch.dtype | None) -> None:
        """Load the tokenizer and the module (once; threads asking meanwhile wait)."""
        if self.module is not None:
            return
        with self.lock:
            if self.module is None:
                import transformers

                import nostall

                self.tokenizer = transformers.AutoTokenizer.from_pretrained(self.tokenizer_folder)
                self.module = nostall.load_model(self.folder, device=device, dtype=dtype)
                self.module.eval()
                log.info("loaded text encoder %s on %s", ", ".join(self.names), device)


def encoders_of(store: Any) -> dict[str, Encoder]:
    """Every text encoder of ``store`` (a :class:`~nostall.cache.Store`) by its
    ``<pipeline>/<role>`` names; names of the same bytes share one :class:`Encoder`."""
    by_name: dict[str, Encoder] = {}
    by_digest: dict[str, Encoder] = {}
    for pname in store.names():
        entry = store.entry(pname)
        for role, c in entry.components.items():
            if c is None or role not in TOKENIZERS or not c.weights:
                continue
            tok = os.path.join(entry.folder, TOKENIZERS[role])
            enc = by_digest.get(c.digest)
            if enc is None:
                enc = by_digest[c.digest] = Encoder(c.digest, [], c.folder, tok)
            enc.names.append(f"{pname}/{role}")
            by_name[f"{pname}/{role}"] = enc
    return by_name


def _not_int(v: Any) -> bool:
    return isinstance(v, bool) or not isinstance(v, int)


def _read_shape(enc: Encoder, cap: int) -> Shape:
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
    return Shape(limit, default, int(config.num_hidden_layers) + 1, positions)
