"""Capture hygiene that holds on any machine: no garbage collection during a capture, graphs released on drop."""

import gc
import weakref

import torch

from flashdraft.speculative.engine import graphs, session

from .. import one_thread, tiny_target  # noqa: F401 (autouse fixture)


class _Cycle:
    def __init__(self):
        self.me = self


def test_a_capture_collects_dead_cycles_first_and_none_during_it():
    dead = _Cycle()
    alive = weakref.ref(dead)
    del dead
    was_enabled = gc.isenabled()
    with graphs._no_garbage_collection():
        assert alive() is None  # collected on entry, before the capture begins
        assert not gc.isenabled()
    assert gc.isenabled() == was_enabled


def test_dropping_a_session_releases_its_graphs_at_once():
    target = tiny_target("qwen3", dtype=torch.float32)
    sess = session.session(target, 64, 4, None, graphs=False)
    marker = object()
    for step in sess.engine.steps.values():
        step.graph = marker  # stands in for a captured graph
    session.session(target, 64, 8, None, graphs=False)  # another block size: a new session replaces it
    assert session.current_session(target) is not sess
    assert all(step.graph is None for step in sess.engine.steps.values())
    session.drop_session(target)
