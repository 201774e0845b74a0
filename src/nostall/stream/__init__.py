"""Partial residency: the repeated blocks of a module (:mod:`~nostall.stream.blocks`),
the cost model that decides which of them stream (:mod:`~nostall.stream.cost`), and the
ring that streams them from pinned host memory through a few device buffers
(:mod:`~nostall.stream.ring`). The model cache uses them for a component that does not
fit its share of the device tier (:mod:`nostall.cache.partial`)."""
