"""The garbage collector's thresholds that ``xds-server serve`` and its probe workers set."""
from __future__ import annotations

import gc

from xds_server.process import gc_tuning


def test_tune_sets_the_thresholds_and_returns_the_ones_before():
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)  # CPython's default
        assert gc_tuning.tune() == (700, 10, 10)
        assert gc.get_threshold() == gc_tuning.THRESHOLDS
        young, middle, old = gc_tuning.THRESHOLDS
        assert young >= 10_000 and middle >= 10 and old >= 10  # young collections rare, full ones rarer
    finally:
        gc.set_threshold(*before)


def test_the_serve_command_and_the_probe_workers_tune_their_process():
    """Both entry points call it (their source), before the control plane or the worker runs."""
    import inspect

    from xds_server import cli
    from xds_server.probing.workers import _worker

    serve = inspect.getsource(cli._serve)
    assert serve.index("gc_tuning.tune()") < serve.index("ControlPlane(cfg")
    main = inspect.getsource(_worker.main)
    assert main.index("gc_tuning.tune()") < main.index("event_loop.run(")
