"""graphmem.cli.progress: a tqdm bar on a terminal's stderr, silence everywhere else."""
from __future__ import annotations

import io

import pytest

from graphmem.cli.progress import Progress, progress, quiet


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


def test_bar_on_a_tty_is_cleared_at_the_end() -> None:
    stream = FakeTTY()
    assert list(progress(range(3), desc="fitting", stream=stream, min_interval=0)) == [0, 1, 2]
    out = stream.getvalue()
    assert "fitting" in out and "3/3" in out
    assert out.split("\r")[-1].strip() == ""  # leave=False: the line is cleared


def test_unknown_total_counts() -> None:
    stream = FakeTTY()
    list(progress(iter("ab"), desc="captures", stream=stream, min_interval=0))
    assert "captures: 2it" in stream.getvalue()


def test_quiet_silences_a_tty() -> None:
    stream = FakeTTY()
    with quiet():
        list(progress(range(3), stream=stream, min_interval=0))
    assert stream.getvalue() == ""
    with quiet(False):  # the CLI's text mode: bars allowed
        list(progress(range(1), stream=stream, min_interval=0))
    assert "1/1" in stream.getvalue() and "0/3" not in stream.getvalue()
