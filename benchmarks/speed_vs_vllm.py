"""kvsim vs vLLM's own Scheduler on the same workload, side by side (not a test).

    PYTHONPATH=$PWD python benchmarks/speed_vs_vllm.py [--vllm 0.33.0] [--seqs 64 256]

For each ``max_num_seqs`` the same scenario (``--requests`` requests of ``--prompt`` prompt
and ``--output`` output tokens, all arriving at t = 0, a pool big enough that nothing is
preempted) runs

* through kvsim as a user runs it: the whole ``kvsim run`` process, imports, workload
  generation and result files included, timed from outside, ``--repeats`` times (the
  median is compared; modules byte-compiled as installed, ``common.kvsim_env``, after one
  untimed warm-up run);
* through vLLM's real Scheduler in its oracle environment (``kvsim/oracle/make_env.sh``),
  driven by ``kvsim/oracle/vllm_driver.py`` with fake model outputs; only the driver's loop
  is timed (``KVSIM_ORACLE_TIMING``: from the first ``schedule()`` to the last output; vLLM's
  imports and engine set-up are left out), and the driver skips recording block tables
  (``KVSIM_ORACLE_NO_BLOCK_IDS``), so the loop is mostly vLLM's own work.

It checks that the two agree request by request (cached tokens, preemptions, first
scheduled / first token / finish step, output tokens) and step by step (scheduled tokens,
preemptions, free blocks), then prints steps/s, simulated requests/s, peak RSS and the
ratios. Exit status 1 if any output differs.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from common import kvsim_command, kvsim_env, repeated, timed

SCENARIO = """\
[model]
preset = "{model}"
[hardware]
preset = "h100-sxm"
[engine]
vllm_version = "{vllm}"
enable_prefix_caching = true
num_gpu_blocks = {blocks}
max_num_seqs = {seqs}
max_num_batched_tokens = {batched}
max_model_len = {mml}
{layout}
[workload]
kind = "synthetic"
generator = "shared_prefix"
num_requests = {requests}
request_rate = inf
system_prompt_tokens = {system}
user_history_tokens = 0
num_users = 1
input_tokens = {prompt}
output_tokens = {output}
[run]
seed = 0
{extra}"""

# 3 drafts of which 2 are accepted at every verify step.
SPEC = """\
[speculative]
method = "{method}"
num_speculative_tokens = 3
acceptance = "fixed"
num_accepted = 2
"""
LLAMA = dict(model="llama-3.1-8b", layout="block_size = 16")
# The workloads: plain decode; EAGLE on prompts that share a system prompt (prefix caching
# hits it); MTP on a full-attention + sliding-window layout (DeepSeek-V3's MTP module, its
# MLA layers as a full-attention group of block 64 holding the MTP layer, and a 128-token
# window group, as DeepSeek-V4 and MiMo-V2 mix them); MTP on Qwen3.5-27B's own layout (three
# Gated DeltaNet groups and a full-attention one, vLLM's Mamba "align" mode, block 832:
# the shared system prompt spans whole blocks).
CASES = {
    "plain": dict(LLAMA, requests=6000, prompt=512, output=256, system=0, extra=""),
    "eagle": dict(LLAMA, requests=12000, prompt=256, output=256, system=256,
                  extra=SPEC.format(method="eagle")),
    "mtp-swa": dict(model="deepseek-v3", layout="""\
[[engine.kv_groups]]
kind = "full_attention"
block_size = 64
eagle = true
[[engine.kv_groups]]
kind = "sliding_window"
block_size = 64
sliding_window = 128""", requests=12000, prompt=256, output=256, system=256,
                    extra=SPEC.format(method="mtp")),
    "mtp-mamba": dict(model="qwen3.5-27b", layout="", requests=6000, prompt=256, output=256,
                      system=2048, extra=SPEC.format(method="mtp")),
}


def state_changes(sc, out: Path) -> dict[str, int]:
    """The state-changing events of the run, the floor any simulator of these semantics pays:
    arrivals, completions, preemptions, and block boundaries (the blocks each request's table
    reaches in each KV group, prompt and outputs and lookahead slots, a prefix hit's
    included)."""
    with open(out / "requests.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    e = sc.engine
    la = sc.speculative.num_speculative_tokens if sc.speculative.method in (
        "eagle", "eagle3", "mtp", "draft_model") else 0
    sizes = [g.block_size for g in e.kv_groups] if e.kv_groups else [e.block_size]  # per group
    blocks = sum(-(-min(int(r["prompt_tokens"]) + int(r["output_tokens"]) + la, e.max_model_len)
                   // b) for r in rows for b in sizes)
    done = sum(r["finish_step"] != "" for r in rows)
    preempted = sum(int(r["num_preemptions"]) for r in rows)
    return {"arrivals": len(rows), "completions": done, "preemptions": preempted,
            "block_boundaries": blocks, "total": len(rows) + done + preempted + blocks}


def compare(out: Path, vllm: dict) -> list[str]:
    """Differences between kvsim's result files and the driver's result."""
    bad = []
    with open(out / "requests.csv", newline="") as f:
        rows = {r["req_id"]: r for r in csv.DictReader(f)}
    fields = (("cached_tokens", "cached_tokens"), ("num_preemptions", "num_preemptions"),
              ("first_scheduled_step", "first_scheduled_step"),
              ("first_token_step", "first_token_step"), ("finish_step", "finish_step"),
              ("output_tokens", "num_output_tokens"))
    for rid, v in vllm["requests"].items():
        row = rows.get(rid)
        for ours, theirs in fields:
            a = None if row is None or row[ours] == "" else int(row[ours])
            if a != v[theirs]:
                bad.append(f"request {rid} {ours}: kvsim {a} vllm {v[theirs]}")
    with open(out / "steps.csv", newline="") as f:
        steps = list(csv.DictReader(f))
    if len(steps) != vllm["num_steps"]:
        bad.append(f"steps: kvsim {len(steps)} vllm {vllm['num_steps']}")
    for s, v in zip(steps, vllm["steps"]):
        pairs = ((int(s["num_scheduled_tokens"]), sum(v["scheduled"].values()), "scheduled tokens"),
                 (int(s["num_preempted"]), len(v["preempted"]), "preempted"),
                 (int(s["num_free_blocks"]), v["num_free_blocks"], "free blocks"))
        bad.extend(f"step {v['step']} {what}: kvsim {a} vllm {b}" for a, b, what in pairs if a != b)
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm", default="0.33.0")
    ap.add_argument("--oracle-python", default=None)
    ap.add_argument("--case", choices=sorted(CASES), nargs="+", default=sorted(CASES))
    ap.add_argument("--seqs", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--requests", type=int, default=None, help="(default: the case's)")
    ap.add_argument("--prompt", type=int, default=None, help="(default: the case's)")
    ap.add_argument("--output", type=int, default=None, help="(default: the case's)")
    ap.add_argument("--num-gpu-blocks", type=int, default=16384)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3, help="kvsim runs per setting (median)")
    ap.add_argument("--keep", default=None, help="keep the scenarios and results in this folder")
    args = ap.parse_args()

    from kvsim.config import load_scenario
    from kvsim.oracle.validate import DRIVER, driver_scenario, oracle_python

    python = oracle_python(args.vllm, args.oracle_python)
    work = Path(args.keep or tempfile.mkdtemp(prefix="kvsim-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, KVSIM_ORACLE_TIMING="1", KVSIM_ORACLE_NO_BLOCK_IDS="1")
    k_env = kvsim_env(work / "pycache")
    lines = []
    failed = False
    for case, seqs in [(c, n) for c in args.case for n in args.seqs]:
        w = dict(CASES[case])
        for key in ("requests", "prompt", "output"):
            if getattr(args, key) is not None:
                w[key] = getattr(args, key)
        path = work / f"speed-{case}-{seqs}.toml"
        path.write_text(SCENARIO.format(
            vllm=args.vllm, blocks=args.num_gpu_blocks, seqs=seqs, batched=args.max_num_batched_tokens,
            mml=max(4096, w["system"] + w["prompt"] + w["output"] + 16), **w))
        sc = load_scenario(path)
        # vLLM: the driver's scenario (requests joined where kvsim joins them, accepting the
        # drafts kvsim's run accepted), its loop timed.
        inp, res = work / f"vllm-{case}-{seqs}.in.json", work / f"vllm-{case}-{seqs}.out.json"
        inp.write_text(json.dumps(driver_scenario(sc)))
        v_wall, v_rc, v_rss = timed([str(python), str(DRIVER), str(inp), str(res)], env)
        vllm = json.loads(res.read_text())
        if v_rc or "error" in vllm:
            print(f"{case} max_num_seqs {seqs}: vLLM's driver failed: {vllm.get('error')}")
            return 1
        v_loop = vllm["timing"]["drive_s"]
        # kvsim: the whole process a user starts.
        out = work / f"kvsim-{case}-{seqs}"
        shutil.rmtree(out, ignore_errors=True)
        cmd = [*kvsim_command(), "run", str(path), "--out", str(out), "-q", "--force"]
        if not lines:
            timed(cmd, k_env)  # warm-up: byte-compile kvsim and its imports once
        got = repeated(cmd, k_env, args.repeats)
        if got is None:
            print(f"{case} max_num_seqs {seqs}: kvsim run failed")
            return 1
        walls, k_rss = got
        k_wall = statistics.median(walls)
        print(f"{case} max_num_seqs {seqs}: kvsim run " + ", ".join(f"{x:.2f}" for x in walls)
              + f" s; vLLM loop {v_loop:.2f} s", flush=True)
        bad = compare(out, vllm)
        failed |= bool(bad)
        n_steps, n_req = vllm["num_steps"], len(vllm["requests"])
        events = state_changes(sc, out)["total"]
        lines.append((case, seqs, n_steps, n_req, v_loop, v_wall, v_rss, k_wall, k_rss, events, bad))
    print(f"vLLM {args.vllm} semantics, {args.num_gpu_blocks} blocks, max_num_batched_tokens "
          f"{args.max_num_batched_tokens}; events: arrivals + completions + preemptions + block "
          f"boundaries")
    print(f"{'case':>9} {'requests':>9} {'max_num_seqs':>12} {'steps':>7}  {'vLLM loop s':>11} "
          f"{'steps/s':>8} {'RSS MiB':>7}  {'kvsim run s':>11} {'steps/s':>8} {'req/s':>7} "
          f"{'RSS MiB':>7} {'events':>9} {'us/event':>8}  {'speed-up':>8}  outputs")
    for case, seqs, n_steps, n_req, v_loop, _, v_rss, k_wall, k_rss, events, bad in lines:
        print(f"{case:>9} {n_req:>9} {seqs:>12} {n_steps:>7}  {v_loop:>11.2f} "
              f"{n_steps / v_loop:>8.0f} {v_rss:>7}  {k_wall:>11.2f} {n_steps / k_wall:>8.0f} "
              f"{n_req / k_wall:>7.0f} {k_rss:>7} {events:>9} {1e6 * k_wall / events:>8.1f}  "
              f"{v_loop / k_wall:>7.1f}x  {'identical' if not bad else f'{len(bad)} differences'}")
        for b in bad[:5]:
            print(f"    {b}")
    print("(vLLM RSS: the driver process, torch and vLLM imports included; its wall time "
          "with set-up: " + ", ".join(f"{x[5]:.1f} s" for x in lines) + ")")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
