"""graphmem.progress: a bar on a terminal's stderr, silence everywhere else."""
from __future__ import annotations

import io

import pytest

from graphmem.progress import Progress, progress, quiet


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_silent_when_not_a_tty() -> None:
    stream = io.StringIO()  # a pipe, a file, a CI log
    assert list(progress(range(3), desc="fitting", stream=stream)) == [0, 1, 2]
    with Progress(total=2, stream=stream) as bar:
        bar.update(2)
    assert stream.getvalue() == ""


def test_silent_under_pytest_capture(capsys: pytest.CaptureFixture[str]) -> None:
    assert list(progress([1, 2], desc="x")) == [1, 2]  # the default stream is sys.stderr, captured here
    assert capsys.readouterr() == ("", "")


def test_bar_on_a_tty() -> None:
    stream = FakeTTY()
    assert list(progress(range(3), desc="fitting", stream=stream, min_interval=0)) == [0, 1, 2]
    frames = stream.getvalue().split("\r")
    assert frames[1:5] == ["[........................] 0/3  fitting",
                           "[########................] 1/3  fitting",
                           "[################........] 2/3  fitting",
                           "[########################] 3/3  fitting"]
    assert frames[5:] == [" " * len(frames[4]), ""]  # the line is cleared at the end


def test_unknown_total_counts() -> None:
    stream = FakeTTY()
    list(progress(iter("ab"), desc="captures", stream=stream, min_interval=0))
    assert stream.getvalue().split("\r")[1:4] == ["[0]  captures", "[1]  captures", "[2]  captures"]


def test_throttled_but_the_last_step_draws() -> None:
    stream = FakeTTY()
    with Progress(total=1000, stream=stream, min_interval=3600) as bar:
        for _ in range(1000):
            bar.update()
    frames = stream.getvalue().split("\r")
    assert frames[1:3] == ["[........................] 0/1000", "[########################] 1000/1000"]


def test_quiet_silences_a_tty() -> None:
    stream = FakeTTY()
    with quiet():
        list(progress(range(3), stream=stream, min_interval=0))
    with quiet(False):  # the CLI's text mode: bars allowed
        list(progress(range(1), stream=stream, min_interval=0))
    assert stream.getvalue().startswith("\r[........................] 0/1")
    assert "0/3" not in stream.getvalue()
