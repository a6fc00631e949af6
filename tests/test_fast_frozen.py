"""`fast_init` builds the same instances as the `__init__` that `dataclass(frozen=True)` writes."""

from __future__ import annotations

import dataclasses
from dataclasses import InitVar, dataclass, field

import pytest

from asyncpp.core.plan import ScheduledRequest
from asyncpp.engine.outputs import RequestOutput
from asyncpp.fast_frozen import fast_init


def _sample_class() -> type:
    @dataclass(frozen=True)
    class Sample:
        name: str
        ids: list[int] = field(default_factory=list)
        count: int = 3
        seen: list[str] = field(default_factory=lambda: ["x"])

    return Sample


def _stock(cls: type) -> type:
    """The same fields, with the `__init__` dataclasses writes."""
    spec = [(f.name, f.type, field(default=f.default, default_factory=f.default_factory)) for f in dataclasses.fields(cls)]
    return dataclasses.make_dataclass(cls.__name__, spec, frozen=True)


def _assert_same(fast: object, stock: object) -> None:
    assert list(vars(fast).items()) == list(vars(stock).items())


def test_same_instance_as_the_stock_init_for_every_way_of_calling_it():
    stock, fast = _sample_class(), fast_init(_sample_class())
    calls = [(("a",), {}), (("a", [1]), {}), (("a", [1], 5, ["y"]), {}), ((), {"name": "a", "count": 7}), (("a",), {"seen": []})]
    for args, kwargs in calls:
        _assert_same(fast(*args, **kwargs), stock(*args, **kwargs))
    first, second = fast("a"), fast("a")
    assert first.ids is not second.ids and first.seen is not second.seen  # a fresh default each time
    assert first == second
    with pytest.raises(TypeError):
        fast()
    with pytest.raises(TypeError):
        fast("a", bogus=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.name = "b"


@pytest.mark.parametrize(
    "cls, args",
    [
        (ScheduledRequest, ("r", [1, 2], 4, [0, 1], True)),
        (RequestOutput, ("r", "t", [5], True, "stop", 2, None, 64, 16)),
    ],
)
def test_the_hot_messages_are_built_fast_and_stay_frozen(cls, args):
    assert "update" in cls.__init__.__code__.co_names  # the stock one calls object.__setattr__ per field
    built = cls(*args)
    _assert_same(built, _stock(cls)(*args))
    assert built == cls(*args)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(built, dataclasses.fields(cls)[0].name, None)


def test_post_init_still_runs():
    @fast_init
    @dataclass(frozen=True)
    class Checked:
        value: int

        def __post_init__(self) -> None:
            if self.value < 0:
                raise ValueError("negative")

    assert Checked(1).value == 1
    with pytest.raises(ValueError):
        Checked(-1)


def test_refuses_what_it_cannot_build():
    @dataclass
    class Mutable:
        value: int

    @dataclass(frozen=True, slots=True)
    class Slotted:
        value: int

    @dataclass(frozen=True)
    class WithInitVar:
        value: int
        extra: InitVar[int] = 0

    @dataclass(frozen=True)
    class KeywordOnly:
        value: int = field(kw_only=True)

    for cls in (Mutable, Slotted, WithInitVar, KeywordOnly):
        with pytest.raises(TypeError):
            fast_init(cls)
