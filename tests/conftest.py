"""Fixtures shared by every test package: tiny aiohttp servers on free 127.0.0.1 ports."""
from __future__ import annotations

import asyncio
import inspect
import os
import sys
from pathlib import Path

# The gRPC C core's own stderr lines (GOAWAY notes and the like) are noise in test output: off
# unless the environment asks for them. Set before any test module imports grpc.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from hypothesis import HealthCheck, settings

# No per-example deadline (Hypothesis's default is 200 ms) and no too-slow health check: under two
# workers a property test shares the 2 cores with a fleet's Envoy and engines, and one slow example
# there is the machine, not the code (a run failed on 407 ms where the same example took 20 ms).
# Speed is measured in benchmarks/, never in timed tests; the suite's hang guard is pytest-timeout.
settings.register_profile("suite", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("suite")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# Where a module goes in the workers' queue (``--no-loadscope-reorder``: in collection order, set
# here): modules that start a real Envoy, then the other process tests, then the in-process ones.
# The longest modules go out first and the many short ones fill the workers' ends, so no worker
# starts a 40 s module while the others have run out of work.
_QUEUE_ORDER = ("faults", "integration", "relay", "deploy", "unit", "conformance", "property")


_PROCESS_KINDS = _QUEUE_ORDER[:_QUEUE_ORDER.index("unit")]  # the kinds whose modules start processes

# A module that starts processes (a real Envoy, or its kind's fleets) goes out as a group named
# ``FLEET`` + its path; at most :data:`_FLEETS_AT_ONCE` such groups run at once
# (:class:`_AtMostTwoFleets`).
_FLEET = "fleet:"
_FLEETS_AT_ONCE = 2


def _queue_rank(item: pytest.Item, tests_dir: Path) -> tuple[int, int]:
    top = item.path.relative_to(tests_dir).parts[0]
    envoy = item.get_closest_marker("envoy") is not None
    return (0 if envoy else 1, _QUEUE_ORDER.index(top) if top in _QUEUE_ORDER else len(_QUEUE_ORDER))


def _starts_processes(rank: tuple[int, int]) -> bool:
    return rank[0] == 0 or rank[1] < len(_PROCESS_KINDS)


@pytest.hookimpl(optionalhook=True)  # xdist's hook: unknown where xdist is not loaded
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """Under ``--dist loadgroup``: xdist's loadgroup scheduler, where a worker that asks for work
    while :data:`_FLEETS_AT_ONCE` others run a module that starts processes takes the queue's
    first in-process module instead (while one is left). Three workers on two cores are then
    two fleets and an in-process module at most, as two workers were at their worst, not three
    fleets at once: the fleet tests' timing bounds were measured that way (three fleets at once
    failed one timing test of a different module in about one run of two)."""
    if config.getoption("dist", None) != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling
    from xdist.workermanage import WorkerController

    class _AtMostTwoFleets(LoadGroupScheduling):
        def _assign_work_unit(self, node: WorkerController) -> None:
            fleets = sum(1 for other, work in self.assigned_work.items() if other is not node
                         for scope, tests in work.items() if scope.startswith(_FLEET) and not all(tests.values()))
            if fleets >= _FLEETS_AT_ONCE:
                light = next((scope for scope in self.workqueue if not scope.startswith(_FLEET)), None)
                if light is not None:
                    self.workqueue.move_to_end(light, last=False)
            super()._assign_work_unit(node)

    return _AtMostTwoFleets(config, log)


# The property tests yield the CPU to the rest: under three workers on two cores, a worker running
# a hypothesis module (pure computation, a core's worth of CPU, no timing asserted) at nice 10,
# every other module at 0, so the fleets' and the in-process timing bounds hold as they were
# measured beside two workers. Only as root (CI), where the niceness can be lowered again; the
# zygote, whose forks are the fleets' processes, is started at session start, at nice 0.
_PURE_NICE = 10


def _lanes(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput") and getattr(config.option, "loadgroup", False) and \
        hasattr(os, "setpriority") and os.geteuid() == 0


def pytest_sessionstart(session: pytest.Session) -> None:
    if _lanes(session.config):
        from xds_server.testing._zygote import Zygote
        Zygote.shared()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Each test runs at its module's niceness (see :data:`_PURE_NICE`), set before its module's
    fixtures start anything."""
    if not _lanes(item.config):
        return
    want = _PURE_NICE if "@property/" in item.nodeid else 0
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) != want:
            os.setpriority(os.PRIO_PROCESS, 0, want)
    except OSError:  # not permitted here: one priority for all, as without lanes
        pass


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Groups for pytest-xdist's ``--dist loadgroup`` (the README's test command runs ``-n 3``):
    each test module is a group of its own, so its module fixtures (a shared fleet, a built
    table) are built once, on one worker; the modules go out in :data:`_QUEUE_ORDER` (a
    module's rank is its first test's, so a module stays whole). The timing bounds the fleet
    tests assert hold with the other workers' fleets and hypothesis runs beside them (measured
    in the suite's own runs, not assumed).

    On a worker the group goes into the node id as ``ID@GROUP``, the form xdist's loadgroup
    scheduler splits on (its own hook, which should do this from ``xdist_group`` marks, left the
    ids as they were in this setup). Without ``-n`` nothing changes."""
    if not (hasattr(config, "workerinput") and getattr(config.option, "loadgroup", False)):
        return
    tests_dir = Path(__file__).parent
    rank: dict[Path, tuple[int, int]] = {}
    for item in items:
        rank.setdefault(item.path, _queue_rank(item, tests_dir))
    items.sort(key=lambda item: rank[item.path])  # stable: collection order within a rank
    for item in items:
        group = (_FLEET if _starts_processes(rank[item.path]) else "") + item.path.relative_to(tests_dir).as_posix()
        if not item.nodeid.endswith("@" + group):
            _set_nodeid(item, f"{item.nodeid}@{group}")


def _set_nodeid(item: pytest.Item, nodeid: str) -> None:
    """``item``'s node id, where pytest keeps it: ``_id`` (a NodeId) since pytest 9, ``_nodeid``
    before (where xdist 3.8 still writes it, so its own loadgroup hook has no effect on 9)."""
    if hasattr(item, "_id"):
        from _pytest.nodeid import coerce_node_id
        item._id = coerce_node_id(nodeid)
    else:
        item._nodeid = nodeid


@pytest.fixture
async def serve():
    """``await serve({(method, path): handler})`` starts an aiohttp app on 127.0.0.1 (free port)
    and returns its base URL; every app is stopped at teardown."""
    runners: list[web.AppRunner] = []

    async def start(routes: dict[tuple[str, str], Handler]) -> str:
        app = web.Application()
        for (method, path), handler in routes.items():
            app.router.add_route(method, path, handler)
        runner = web.AppRunner(app, shutdown_timeout=0.2, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        host, port = runner.addresses[0][:2]
        return f"http://{host}:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


# -- a hung async test shows its tasks --------------------------------------------------------

_TASKS_SHOWN_BEFORE_S = 20.0
"""How long before pytest-timeout ends an async test its loop's tasks are printed."""

_TIMEOUT_S = pytest.StashKey[float]()
"""The item's timeout as pytest-timeout resolved it (marker, ``--timeout``, ini), in s."""


@pytest.hookimpl(optionalhook=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> None:
    """Note the timeout pytest-timeout is about to arm (before the item's fixtures are set up);
    None: pytest-timeout arms it as usual."""
    item.stash[_TIMEOUT_S] = float(settings.timeout or 0)


def pytest_itemcollected(item: pytest.Item) -> None:
    """Every async test gets :func:`_tasks_shown_before_the_timeout` first, so that it is torn
    down last and covers the other fixtures' teardown too."""
    if isinstance(item, pytest.Function) and inspect.iscoroutinefunction(item.obj):
        item.fixturenames.insert(0, "_tasks_shown_before_the_timeout")


@pytest.fixture
async def _tasks_shown_before_the_timeout(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    """An async test (with its fixtures) still running :data:`_TASKS_SHOWN_BEFORE_S` before
    pytest-timeout ends it prints every task of its loop with its stack to stderr, shown with the
    failure. A hang inside the loop (a stop awaiting a task that never ends) shows there; the
    timeout's own dump shows the threads, where such a loop is only idle in ``select``. It
    watches the test's function-scoped loop (the suite's scope); nothing without pytest-timeout,
    or with its ``func_only``."""
    limit = request.node.stash.get(_TIMEOUT_S, 0.0)
    if limit <= _TASKS_SHOWN_BEFORE_S:
        yield
        return
    handle = asyncio.get_running_loop().call_later(limit - _TASKS_SHOWN_BEFORE_S, _print_tasks, request.node.nodeid)
    try:
        yield
    finally:
        handle.cancel()


def _print_tasks(nodeid: str) -> None:
    tasks = asyncio.all_tasks()
    print(f"\n--- {nodeid}: still running {_TASKS_SHOWN_BEFORE_S:g} s before its timeout; "
          f"its loop's {len(tasks)} tasks:", file=sys.stderr)
    for task in tasks:
        task.print_stack(limit=12, file=sys.stderr)
