"""Routing: which endpoint serves a request, as plugins in the shape of llm-d's endpoint picker.
Pure (no I/O); the gateway and ``slipstream simulate`` both import it.

A ``--routing`` policy names a :class:`Profile` (:mod:`.profiles`): its filters, its scorers and
its picker, by their names in :mod:`.registry`. :class:`Router` builds them once and, per request,
drops the endpoints a filter refuses (those at capacity), sums each scorer's score in [0, 1] times
its weight (:class:`Weights`, keyed by scorer name) and lets the picker choose. When no endpoint is
left, :meth:`Router.pick` returns None and the caller holds the request.

Policies:

- ``round-robin``: endpoints in turn, blind to load (what a ClusterIP Service does).
- ``least-loaded``: the fewest requests queued and running.
- ``prefix``: scorers ``prefix`` (the fraction of the prompt's leading blocks this router sent to
  the endpoint before: its own LRU :class:`PrefixTable`), ``queue``, ``kv_cache``, ``affinity``.
- ``kv-events``: the same with ``kv_events`` for ``prefix``: the fraction the pod's KV cache holds
  by its own KV-cache events (:class:`BlockIndex`), so every gateway replica sees what pods hold.

The picker of the scored policies takes the best weighted sum; ties go to the least loaded, then
take turns. Module map: :mod:`.plugins` (protocols and the values they pass), :mod:`.index`
(the block indexes), ``scorers/`` (one module per scorer), :mod:`.filters`, :mod:`.pickers`,
:mod:`.registry`, :mod:`.profiles`, :mod:`.weights`, :mod:`.router`.
"""
from __future__ import annotations

from slipstream.api_types.routing import DEFAULT_POLICY, DEFAULT_WEIGHTS, POLICIES

from .index import BlockIndex, PrefixIndex, PrefixTable
from .pickers import TIE
from .plugins import Choice, CycleState, EndpointLoad, Filter, Picker, RouteRequest, Scorer
from .profiles import PROFILES, Profile
from .registry import register_scorer
from .router import Router
from .weights import Weights

__all__ = ["BlockIndex", "Choice", "CycleState", "DEFAULT_POLICY", "DEFAULT_WEIGHTS", "EndpointLoad", "Filter",
           "POLICIES", "PROFILES", "Picker", "PrefixIndex", "PrefixTable", "Profile", "RouteRequest", "Router",
           "Scorer", "TIE", "Weights", "register_scorer"]
