"""`asyncpp.progress`: bounded output off a TTY, one redrawn line on a TTY, right figures."""

from __future__ import annotations

import io

import pytest

from asyncpp.progress import Progress, track, weights_span


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class TtyStream(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_non_tty_output_is_bounded():
    out = io.StringIO()
    with Progress(1000, "loading", "it", stream=out, quiet=False) as bar:
        for _ in range(1000):
            bar.update()
    lines = out.getvalue().splitlines()
    assert len(lines) <= 6
    assert "\r" not in out.getvalue()
    assert "0/1000" in lines[0] and "1000/1000" in lines[-1] and "done" in lines[-1]
    assert [line.split()[1] for line in lines] == ["0/1000", "250/1000", "500/1000", "750/1000", "1000/1000"]


def test_non_tty_unknown_total_prints_start_and_end_only():
    out = io.StringIO()
    with Progress(None, "steps", stream=out, quiet=False) as bar:
        for _ in range(500):
            bar.update()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "500 it" in lines[-1]


def test_tty_redraws_one_line_with_carriage_return():
    out, clock = TtyStream(), FakeClock()
    bar = Progress(10, "reqs", "req", stream=out, quiet=False, clock=clock, min_redraw_s=0.0)
    for _ in range(10):
        clock.now += 0.5
        bar.update()
    bar.close()
    text = out.getvalue()
    assert text.count("\r") == bar.num_lines == 12  # start, 10 updates, close
    assert text.count("\n") == 1 and text.endswith("\n")  # the final line stays
    assert "10/10 req (100%)" in text.rsplit("\r", 1)[-1]


def test_tty_redraws_are_rate_limited_and_transient_line_is_erased():
    out, clock = TtyStream(), FakeClock()
    bar = Progress(1000, stream=out, quiet=False, clock=clock, min_redraw_s=1.0, leave=False)
    for _ in range(1000):
        bar.update()  # the clock does not move: no redraw after the first
    bar.close()
    assert bar.num_lines == 2
    assert out.getvalue().endswith("\r\x1b[K") and "\n" not in out.getvalue()


def test_rate_and_eta():
    clock = FakeClock()
    bar = Progress(100, stream=io.StringIO(), quiet=False, clock=clock)
    assert bar.rate is None and bar.eta_s is None
    clock.now += 10.0
    bar.update(25)
    assert bar.count == 25 and bar.total == 100
    assert bar.rate == pytest.approx(2.5)
    assert bar.eta_s == pytest.approx(30.0)
    assert "25/100" in bar.line() and "2.5 it/s" in bar.line() and "ETA 30s" in bar.line()
    clock.now += 30.0
    bar.update(75)
    assert bar.eta_s == 0.0


def test_quiet_prints_nothing(monkeypatch):
    out = io.StringIO()
    with Progress(10, stream=out, quiet=True) as bar:
        bar.update(10)
    monkeypatch.setenv("ASYNCPP_PROGRESS", "off")
    with Progress(10, stream=out) as bar:
        bar.update(10)
    assert out.getvalue() == ""


def test_track_yields_items_unchanged_and_reports_early_stop():
    out = io.StringIO()
    items = list(range(40))
    assert list(track(items, desc="x", stream=out, quiet=False)) == items
    assert "40/40" in out.getvalue().splitlines()[-1]
    out = io.StringIO()
    gen = track(items, stream=out, quiet=False)
    for i in gen:
        if i == 4:
            break
    gen.close()
    assert "stopped" in out.getvalue().splitlines()[-1]


def test_weights_span_names_the_layer_range():
    names = ["model.embed_tokens.weight"] + [f"model.layers.{i}.mlp.up_proj.weight" for i in range(15)]
    assert weights_span(names) == "layers 0-14 + embed"
    tail = [f"model.layers.{i}.input_layernorm.weight" for i in (15, 29)] + ["model.norm.weight", "lm_head.weight"]
    assert weights_span(tail) == "layers 15-29 + head"
    assert weights_span(["model.layers.3.mlp.up_proj.weight"]) == "layer 3"
