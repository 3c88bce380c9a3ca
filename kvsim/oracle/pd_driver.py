#!/usr/bin/env python3
"""Drive two of vLLM's real v1 Schedulers as a prefill/decode pair on CPU: vLLM's own
NixlConnector scheduler code on both sides, only its worker faked (the referee for P/D).

Standalone like ``vllm_driver.py`` (whose engine builder it uses): imports only vllm, torch
and the standard library, never kvsim.

    /path/to/oracle-venv/bin/python kvsim/oracle/pd_driver.py IN.json OUT.json

IN.json holds one scenario or a list of them:
  prefill, decode: engine tables as vllm_driver.py takes them (no kv_offloading); the
          driver adds kv_transfer (NixlConnector, kv_role kv_producer / kv_consumer, engine
          ids "prefill" / "decode").
  kv_recompute_threshold: optional, passed to both sides' kv_connector_extra_config.
  transfer_delay: the decode side's schedule() calls a read of remote blocks takes (0: done
          in the same call's output); a request with nothing to read notifies the prefill
          side at once.
  requests[]: as vllm_driver.py's (req_id, prompt_token_ids, max_tokens, join_step,
          output_token_id, accepted).

The loop runs in ticks. In tick t: the requests with join_step <= t go to the prefill side
as the P/D proxy sends them (the whole prompt, max_tokens 1, kv_transfer_params
{"do_remote_decode": true}); the requests the prefill side finished in tick t - 1 go to the
decode side with the kv_transfer_params its output carried; then each side with requests
(``Scheduler.has_requests``: a finished request whose blocks wait to be read counts) or
batches in flight makes one EngineCore step (schedule, its worker's hooks,
update_from_output; with speculative decoding the drafts as vllm_driver.py gives them;
with async_scheduling one iteration of
vllm_driver.py's batch queue, whose batches carry the worker's report of the call that
scheduled them). The faked workers:
  decode: each reqs_to_recv entry of a step's metadata (schedule() call c of that side) is
          read by call c + transfer_delay (call c if it reads no blocks); then the request
          is reported in finished_recving (if it waits for it) and the prefill side is
          notified;
  prefill: a request in reqs_to_send is reported in finished_sending by the first prefill
          step after the decode side's notification.
The run ends when every request has finished on the decode side and neither side has
requests, or with "stall" (and "error") at the first tick in which nothing was scheduled,
preempted, handed to the worker or reported by it, no read is in flight and nothing is left
to join or hand over: the pair deadlocks there (e.g. a decode pool that holds a prompt but
not the blocks an asynchronous load must leave free).

Output: {"prefill": result, "decode": result, "num_ticks"}, each result in vllm_driver.py's
schema (requests, steps, free_queue_end, totals with the external_* counters), a request's
and a step's numbers being that side's own steps; each step also carries its "tick"; a
decode request also "join_tick". A prefill request's transfer params are checked, not
output: "remote_num_tokens" must equal the prefill's computed tokens.
"""

from __future__ import annotations

import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vllm_driver as vd  # noqa: E402

# The totals' names of vLLM's PrefixCacheStats fields (vllm_driver.py's), in _STAT_KEYS order.
_TOTALS = [k if k.startswith("preempted") else "prefix_cache_" + k for k in vd._STAT_KEYS]


class _Side:
    """One engine of the pair: its scheduler, faked worker and records."""

    def __init__(self, name: str, engine: dict, threshold, delay: int):
        self.name = name
        transfer: dict[str, object] = {
            "kv_role": "kv_producer" if name == "prefill" else "kv_consumer", "engine_id": name}
        if threshold is not None:
            transfer["kv_recompute_threshold"] = int(threshold)
        if "kv_offloading" in engine:
            raise ValueError(f"{name}: kv_offloading is not driven with P/D")
        self.sched, self.hasher, self.warnings, info = vd.build_scheduler(
            {**engine, "kv_transfer": transfer})
        self.spec_k = info["spec_k"]
        self.is_async = info["async"]
        self.queue_size, self.queue_rule = info["queue_size"], info["queue_rule"]
        self.queue: collections.deque = collections.deque()  # batches in flight, newest first
        self.kvm = self.sched.kv_cache_manager
        self.pool = self.kvm.block_pool
        self.delay = delay
        self.calls = 0
        self.step = 0
        self.reqs: dict = {}
        self.per_req: dict[str, dict] = {}
        self.steps: list[dict] = []
        self.totals = dict.fromkeys(
            [*_TOTALS, *("external_" + name for name in _TOTALS)], 0)
        self.reads: dict[str, tuple[int, bool, str]] = {}  # decode: req -> (due, awaiting, remote)
        self.to_send: set[str] = set()  # prefill: finished requests whose blocks wait
        self.notified: set[str] = set()  # prefill: read by the decode side
        self.verify_count: dict[str, int] = {}
        self.accept_plan: dict[str, list[int]] = {}
        self.out_tok: dict[str, int] = {}
        self.finished_now: list[tuple[str, dict | None]] = []
        self.active = False  # the last call changed something, or a read is in flight

    def add(self, spec: dict, params: dict, max_tokens: int, tick: int) -> None:
        s = dict(spec, max_tokens=max_tokens)
        r = vd._make_request(s, self.hasher)
        r.kv_transfer_params = dict(params)
        rid = r.request_id
        self.reqs[rid] = r
        self.out_tok[rid] = int(spec.get("output_token_id", -1))
        self.accept_plan[rid] = list(spec.get("accepted") or [0])
        self.verify_count[rid] = 0
        pr = {"cached_tokens": None, "external_cached_tokens": None, "num_preemptions": 0,
              "first_scheduled_step": None, "first_token_step": None, "finish_step": None,
              "finish_reason": None, "num_output_tokens": 0, "join_tick": tick}
        if self.spec_k:
            pr["num_draft_tokens"] = pr["num_accepted_tokens"] = 0
        self.per_req[rid] = pr
        self.sched.add_request(r)

    def _worker(self, so, peer: _Side):
        """The faked NIXL worker's report for schedule() call ``self.calls``."""
        from vllm.v1.outputs import KVConnectorOutput

        meta = so.kv_connector_metadata
        if meta is not None:
            for rid, m in meta.reqs_to_recv.items():
                blocks = sum(len(g) for g in m.local_block_ids)
                due = self.calls + (self.delay if blocks else 0)
                self.reads[rid] = (due, bool(m.awaiting_kvs), str(m.remote.request_id))
            self.to_send.update(meta.reqs_to_send)
        recving: set[str] = set()
        sending: list[str] = []  # freed in this order (a set's would vary with the hash seed)
        for rid, (due, awaiting, remote) in list(self.reads.items()):
            if due <= self.calls:
                del self.reads[rid]
                if awaiting:
                    recving.add(rid)
                peer.notified.add(remote)
        for rid in sorted(self.to_send & self.notified):
            self.to_send.discard(rid)
            self.notified.discard(rid)
            sending.append(rid)
        if not recving and not sending:
            return None
        return KVConnectorOutput(finished_recving=recving or None, finished_sending=sending or None)

    def call(self, tick: int, peer: _Side) -> None:
        """One EngineCore iteration of this side (vllm_driver.py's batch queue: with
        asynchronous scheduling a batch is scheduled before the previous one's output is
        processed; the worker's report comes with the batch it ran with)."""
        sched = self.sched
        if sched.has_requests():
            self.queue.appendleft(self._schedule(tick, peer))
            executed = self.queue[0][0].total_num_scheduled_tokens > 0
            self.active |= any(q[0].total_num_scheduled_tokens > 0 for q in self.queue)
            if len(self.queue) < self.queue_size and (
                    executed if self.queue_rule == "not_done" else executed or sched.has_requests()):
                return
        elif not self.queue:
            return
        self._process(*self.queue.pop())

    def _schedule(self, tick: int, peer: _Side):
        sched = self.sched
        running_before = {r.request_id for r in sched.running} if self.spec_k else ()
        so = sched.schedule()
        self.calls += 1
        kv_out = self._worker(so, peer)
        meta = so.kv_connector_metadata
        self.active |= bool(so.total_num_scheduled_tokens > 0 or so.preempted_req_ids
                            or kv_out is not None or self.reads
                            or (meta is not None and (meta.reqs_to_recv or meta.reqs_to_send)))
        pst = vd._prefix_stats_dict(self.kvm.make_prefix_cache_stats())
        cst = vd._take_connector_stats(sched)
        for k, name in zip(vd._STAT_KEYS, _TOTALS):
            self.totals[name] += pst[k]
            self.totals["external_" + name] += cst[k]
        nst = dict(so.num_scheduled_tokens)
        rec = None
        spec_info: dict[str, tuple[int, int]] = {}
        if so.total_num_scheduled_tokens > 0:
            sampled, spec_rec = [], {}
            sched_spec = so.scheduled_spec_decode_tokens or {}
            for rid in nst:
                pr = self.per_req[rid]
                if pr["first_scheduled_step"] is None:
                    pr["first_scheduled_step"] = self.step
                r = self.reqs[rid]
                samples = (not r.is_prefill_chunk if self.is_async
                           else r.num_computed_tokens >= r.num_tokens)
                n_drafts = len(sched_spec.get(rid, ()))
                n_acc = 0
                if n_drafts and samples and rid not in running_before:
                    spec_rec[rid] = spec_info[rid] = (n_drafts, 0)
                elif n_drafts and samples:
                    plan = self.accept_plan[rid]
                    n_acc = min(plan[self.verify_count[rid] % len(plan)], n_drafts)
                    self.verify_count[rid] += 1
                    spec_rec[rid] = spec_info[rid] = (n_drafts, n_acc)
                sampled.append([self.out_tok[rid]] * (1 + n_acc) if samples else [])
            mro = vd._model_runner_output(list(nst), sampled)
            rec = {"step": self.step, "tick": tick, "scheduled": nst,
                   "preempted": sorted(so.preempted_req_ids or ()),
                   "block_ids": {rid: [int(b) for b in self.kvm.get_block_ids(rid)[0]]
                                 for rid in nst},
                   "num_free_blocks": None, "prefix_cache": pst, "external_prefix_cache": cst}
            if self.spec_k:
                rec["spec"] = {rid: list(v) for rid, v in spec_rec.items()}
            self.steps.append(rec)
            self.step += 1
        else:
            mro = vd._model_runner_output([], [])
        mro.kv_connector_output = kv_out
        return so, mro, rec, spec_info

    def _process(self, so, mro, rec, spec_info) -> None:
        sched = self.sched
        for rid, (nd, na) in spec_info.items():
            r = sched.requests.get(rid)
            if r is not None and not r.is_finished():
                self.per_req[rid]["num_draft_tokens"] += nd
                self.per_req[rid]["num_accepted_tokens"] += na
        eco = sched.update_from_output(so, mro)
        for client_outs in eco.values():
            for o in client_outs.outputs:
                pr = self.per_req[o.request_id]
                if o.new_token_ids:
                    pr["num_output_tokens"] += len(o.new_token_ids)
                    if pr["first_token_step"] is None:
                        pr["first_token_step"] = rec["step"] if rec else None
                ps = getattr(o, "prefill_stats", None)
                if pr["cached_tokens"] is None and ps is not None:
                    pr["cached_tokens"] = int(ps.num_cached_tokens)
                    pr["external_cached_tokens"] = int(ps.num_external_cached_tokens)
                if o.finish_reason is not None:
                    pr["finish_step"] = rec["step"] if rec else None
                    pr["finish_reason"] = str(o.finish_reason)
                    self.finished_now.append((o.request_id, o.kv_transfer_params))
        if rec is not None:
            rec["num_free_blocks"] = int(self.pool.get_num_free_blocks())
            rec["usage"] = float(self.kvm.usage)
        if (self.spec_k and not self.is_async and rec is not None
                and not getattr(so, "skip_drafts", False)):
            nst = rec["scheduled"]
            d_ids = [rid for rid in nst
                     if (r := sched.requests.get(rid)) is not None and not r.is_finished()
                     and mro.sampled_token_ids[mro.req_id_to_index[rid]]]
            if d_ids:
                sched.update_draft_token_ids(
                    vd._draft_token_ids(d_ids, [[vd.DRAFT_TOKEN_ID] * self.spec_k] * len(d_ids)))

    def result(self) -> dict:
        for rid, r in self.reqs.items():
            self.per_req[rid]["num_preemptions"] = int(r.num_preemptions)
        return {"requests": self.per_req, "steps": self.steps,
                "free_queue_end": [int(b.block_id)
                                   for b in self.pool.free_block_queue.get_all_free_blocks()],
                "totals": self.totals, "num_steps": self.step, "num_schedule_calls": self.calls,
                **({"warnings": self.warnings} if self.warnings else {})}


# What the P/D proxy sends the prefill side (vLLM's examples' toy_proxy_server.py).
PROXY_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}


def drive(scenario: dict, max_ticks: int = 200_000) -> dict:
    specs = list(scenario["requests"])
    ids = [str(s["req_id"]) for s in specs]
    if len(set(ids)) != len(ids):
        raise ValueError("duplicate req_id")
    threshold = scenario.get("kv_recompute_threshold")
    delay = int(scenario.get("transfer_delay", 0))
    p = _Side("prefill", scenario.get("prefill", {}), threshold, delay)
    d = _Side("decode", scenario.get("decode", {}), threshold, delay)
    by_id = {str(s["req_id"]): s for s in specs}
    pending = specs
    handover: list[tuple[str, dict | None]] = []
    tick = done = 0
    error = None
    stall = None
    while True:
        for s in [s for s in pending if int(s.get("join_step", 0)) <= tick]:
            p.add(s, PROXY_PARAMS, 1, tick)
        pending = [s for s in pending if int(s.get("join_step", 0)) > tick]
        for rid, params in handover:
            if params is None:
                raise RuntimeError(f"prefill finished {rid} without kv_transfer_params")
            if params.get("remote_num_tokens") != p.reqs[rid].num_computed_tokens:
                raise RuntimeError(f"{rid}: remote_num_tokens {params.get('remote_num_tokens')}")
            d.add(by_id[rid], params, int(by_id[rid]["max_tokens"]), tick)
        handover = []
        if (done == len(specs) and not p.sched.has_requests() and not d.sched.has_requests()
                and not p.queue and not d.queue):
            break
        if tick >= max_ticks:
            error = f"max_ticks ({max_ticks}) exceeded"
            break
        p.active = d.active = False
        p.call(tick, d)
        handover, p.finished_now = p.finished_now, []
        d.call(tick, p)
        d.finished_now = []
        done = sum(pr["finish_step"] is not None for pr in d.per_req.values())
        if done < len(specs) and not (pending or handover or p.active or d.active):
            # Nothing ran, moved or is in flight, and nothing will join: the pair deadlocks.
            stall = tick
            error = f"stall at tick {tick}"
            break
        tick += 1
    out = {"vllm_version": vd.VLLM_VERSION, "prefill": p.result(), "decode": d.result(),
           "num_ticks": tick}
    if error is not None:
        out["error"] = error
    if stall is not None:
        out["stall"] = stall
    return out


def _drive_safe(scenario: dict) -> dict:
    try:
        return drive(scenario, int(scenario.get("max_ticks", 200_000)))
    except Exception as exc:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        return {"vllm_version": vd.VLLM_VERSION, "error": f"{type(exc).__name__}: {exc}",
                "exception": type(exc).__name__}


if __name__ == "__main__":
    sys.exit(vd.main(sys.argv, _drive_safe))
