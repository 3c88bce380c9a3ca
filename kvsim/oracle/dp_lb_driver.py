"""vLLM's own DP load balancer (``DPLBAsyncMPClient.get_core_engine_for_request``) on a given
stream, run inside a vLLM release's environment (no engines, no GPU): the referee of
``kvsim.dp.Client``.

Reads JSON on stdin: a list of streams, each ``{"ranks": n, "client_count": c,
"client_index": i, "events": [...]}``
with events in time order, each ``["publish", counts]`` (the coordinator's per-rank lists,
replacing the client's), ``["finish", request_id]`` (its output reaches the client: 0.32+
lowers its in-flight count) or ``["route", request_id]``; writes the ranks routed to, in
order, one JSON list per stream (to the file named as the argument, else stdout). The
client is made with ``object.__new__`` (its ``__init__`` would start engine processes) and
given the attributes its balancing reads.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import json
import sys
import types

from vllm.v1.engine.core_client import DPLBAsyncMPClient


def main() -> None:
    routes = [route(spec) for spec in json.load(sys.stdin)]
    # To the file named (vLLM may log on stdout), else to stdout.
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w", encoding="utf-8") as f:
            json.dump(routes, f)
    else:
        json.dump(routes, sys.stdout)


def route(spec: dict) -> list[int]:
    """The ranks one client routes a stream's requests to."""
    n, count, index = spec["ranks"], spec["client_count"], spec["client_index"]
    c = object.__new__(DPLBAsyncMPClient)
    c.core_engines = [i.to_bytes(2, "little") for i in range(n)]
    c.client_count = count
    c.eng_start_index = (n * index) // count
    c.reqs_in_flight = {}
    # 0.32+ keeps exact in-flight counts and publishes [waiting, running, kv_usage].
    inflight = "engine_inflight" in inspect.getsource(DPLBAsyncMPClient)
    c.lb_engines = [[0, 0, 0.0] if inflight else [0, 0] for _ in range(n)]
    c.engine_inflight = collections.Counter()
    c.streaming_reqs = set()
    out = []
    for kind, arg in spec["events"]:
        if kind == "publish":
            c.lb_engines = [list(x) for x in arg]
        elif kind == "finish":
            if hasattr(DPLBAsyncMPClient, "process_engine_outputs"):
                asyncio.run(DPLBAsyncMPClient.process_engine_outputs(
                    c, types.SimpleNamespace(finished_requests={arg})))
        else:
            req = types.SimpleNamespace(request_id=arg, data_parallel_rank=None, pooling_params=None,
                                        resumable=False)
            out.append(int.from_bytes(c.get_core_engine_for_request(req), "little"))
    return out


if __name__ == "__main__":
    main()
