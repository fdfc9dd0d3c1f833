"""The `jaxinfer` program's exit (jaxinfer.cli.run): main's code, after the exit handlers ran and
the streams were flushed, without the interpreter's teardown; the ordinary exit while a thread
still works."""

from __future__ import annotations

import atexit
import os
import threading

import pytest

import jaxinfer.cli as cli


class Exited(Exception):
    pass


@pytest.fixture
def exits(monkeypatch):
    calls: list[object] = []
    monkeypatch.setattr(cli, "main", lambda: 3)
    monkeypatch.setattr(atexit, "_run_exitfuncs", lambda: calls.append("handlers"))

    def fake_exit(code: int) -> None:
        calls.append(code)
        raise Exited

    monkeypatch.setattr(os, "_exit", fake_exit)
    return calls


def test_leaves_with_mains_code_after_the_exit_handlers(exits):
    with pytest.raises(Exited):
        cli.run()
    assert exits == ["handlers", 3]


def test_a_working_thread_gets_the_ordinary_exit(exits):
    done = threading.Event()
    worker = threading.Thread(target=done.wait)
    worker.start()
    try:
        with pytest.raises(SystemExit) as raised:
            cli.run()
    finally:
        done.set()
        worker.join()
    assert raised.value.code == 3 and exits == []
