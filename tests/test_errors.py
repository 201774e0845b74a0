"""The error tree travels between processes (Ray and multiprocessing pickle errors)."""

from __future__ import annotations

import inspect
import pickle

import pytest

from nostall import errors


def _examples():
    for name, cls in inspect.getmembers(errors, inspect.isclass):
        if issubclass(cls, errors.NostallError):
            yield pytest.param(cls, id=name)


def _build(cls):
    """One instance, with every keyword its constructor takes set to a recognisable value."""
    kw = {}
    try:
        params = list(inspect.signature(cls).parameters.values())[1:]
    except ValueError:  # Exception's own __init__: a message only
        params = []
    for p in params:
        if p.kind is p.KEYWORD_ONLY:
            kw[p.name] = (
                [p.name]
                if p.name in ("available", "close")
                else (7 if p.name in ("requested", "budget", "in_use") else f"<{p.name}>")
            )
    return cls("what happened and the fix", **kw), kw


@pytest.mark.parametrize("cls", list(_examples()))
def test_every_error_pickles_with_its_message_and_attributes(cls):
    err, kw = _build(cls)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls
    assert str(back) == str(err)
    for name in kw:
        assert getattr(back, name) == getattr(err, name), name


def test_an_error_with_a_keyword_only_attribute_would_not_pickle_by_default():
    # what __reduce__ is for: BaseException's own reduction calls cls(*args)
    err = errors.UnknownModel("no model 'x'", name="x", available=["a"], close=[])
    cls, args = Exception.__reduce__(err)[:2]
    with pytest.raises(TypeError):
        cls(*args)
