"""Tokenizers built offline from tiny vocabularies: byte-level BPE for CLIP, a unigram
vocabulary for T5. No machine here reaches a model hub, and the synthetic pipelines only
need token ids in range."""

from __future__ import annotations

import string

__all__ = ["clip_tokenizer", "t5_tokenizer"]


def clip_tokenizer(max_length: int):
    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in bytes_to_unicode().values():
        vocab.setdefault(c, len(vocab))
    for c in bytes_to_unicode().values():
        vocab.setdefault(c + "</w>", len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)


def t5_tokenizer(max_length: int = 512):
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(c, -3.0) for c in string.printable if not c.isspace()]
    pieces += [("▁" + c, -2.5) for c in string.ascii_lowercase]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)
