"""Fixtures of the reliability suite (helpers live in helpers.py).

The suite shares one Serve instance (one HTTP port on 127.0.0.1) per package run, and one
small TP=1 app between the load, disconnect and bad-input modules; the rank-failure and
shutdown modules run their own apps next to it, under their own route prefixes.
"""
from __future__ import annotations

import json
import time

import pytest

from .helpers import (FIGURES, SHARED_BLOCKS, SHARED_MAX_NUM_SEQS, App, app_args,
                      app_status, delete_app, deploy, record)


@pytest.fixture(scope="package")
def _shared_app_holder(serve_instance):
    holder: dict = {}
    yield holder
    if "app" in holder and serve_instance.alive():
        delete_app(holder["app"].name)


@pytest.fixture
def shared_app(serve_instance, _shared_app_holder, tiny_model) -> App:
    """The TP=1 app shared by the load, disconnect and bad-input modules (started once)."""
    app = _shared_app_holder.get("app")
    if app is None or not serve_instance.alive() or app_status(app.name) is None:
        args = app_args(tiny_model, max_num_seqs=SHARED_MAX_NUM_SEQS,
                        engine_kwargs={"num_gpu_blocks_override": SHARED_BLOCKS})
        started = time.monotonic()
        app = deploy(serve_instance, "rel-shared", args)
        record("shared_app", ready_s=round(time.monotonic() - started, 1))
        _shared_app_holder["app"] = app
    return app


def pytest_terminal_summary(terminalreporter):
    if FIGURES:
        terminalreporter.section("reliability figures")
        for test, figures in FIGURES.items():
            terminalreporter.write_line(f"{test}: {json.dumps(figures)}")
