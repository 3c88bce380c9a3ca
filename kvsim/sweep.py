"""``kvsim sweep``: a base scenario run at every point of a grid of overrides, in parallel.

A sweep file (docs/sweep.md) names a base scenario (a path, or an inline ``[scenario]``
table), a ``[grid]`` of values per ``section.key`` (their cartesian product), explicit
``[[points]]`` (each combined with every grid combination) and ``repeats`` over seeds
(``run.seed``, ``run.seed + 1``, ...). Every point is validated before anything runs, so a bad
grid fails at once, naming its key. Points run on local processes or as Ray tasks; each
returns its result files as text and this process writes them, one rename per point folder, so
a restarted sweep skips every point whose folder holds the same resolved scenario. The tidy
table, ``sweep.csv`` (one row per point: the overridden keys, then the headline metrics), is
written last.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import shutil
import tomllib
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvsim import compare, overrides
from kvsim.config import load_raw, parse_scenario
from kvsim.errors import ConfigError
from kvsim.results import is_partial, write_file, write_results
from kvsim.scenario_text import resolved_toml
from kvsim.schema import SCHEMA

SWEEP_KEYS = ("scenario", "grid", "points", "repeats")
MAX_NAME = 96  # longest point folder name before it is cut and given a hash


@dataclass(frozen=True, slots=True)
class Point:
    name: str  # folder under points/
    overrides: dict  # "section.key" -> value, as given (run.seed included with repeats)
    raw: dict  # the scenario table with the overrides applied
    resolved: str  # scenario.resolved.toml of this point


@dataclass(frozen=True, slots=True)
class Sweep:
    path: Path  # relative paths in the scenario resolve against this file's folder
    keys: tuple[str, ...]  # the overridden keys, in order: the table's first columns
    points: tuple[Point, ...]


# -- reading and validating --------------------------------------------------------------


def _flat(table, where: str) -> dict:
    """``{"engine": {"block_size": v}}`` or ``{"engine.block_size": v}`` -> ``{"engine.block_size": v}``."""
    if not isinstance(table, dict):
        raise ConfigError(where, "must be a table of section.key = value")
    out = {}
    for name, value in table.items():
        if "." in name:
            items = [(name, value)]
        elif isinstance(value, dict):
            items = [(f"{name}.{k}", v) for k, v in value.items()]
        else:
            raise ConfigError(f"{where}.{name}", "name a scenario key as section.key")
        for key, v in items:
            section, _, k = key.partition(".")
            if not section or not k or "." in k:
                raise ConfigError(f"{where}.{key}", "name one scenario key as section.key")
            out[key] = v
    return out


def _label(key: str, value, ambiguous: set[str]) -> str:
    short = key.partition(".")[2]
    return overrides.label(key if short in ambiguous else short, value)


def _name(parts: list[str], taken: set[str]) -> str:
    name = compare.slug(" ".join(parts)) if parts else "base"
    if len(name) > MAX_NAME:
        name = name[:MAX_NAME - 9] + "-" + hashlib.sha1(name.encode()).hexdigest()[:8]
    base, i = name, 1
    while name in taken:
        i += 1
        name = f"{base}-{i}"
    taken.add(name)
    return name


def _check_point(raw: dict, path: Path, given: dict, origin: dict) -> str:
    """Validate one point's scenario; an error about an overridden key names where it was set."""
    try:
        return resolved_toml(parse_scenario(raw, path))
    except ConfigError as exc:
        at = exc.where.rpartition(": ")[2]
        for key in given:
            section = key.partition(".")[0]
            if at == key or at.startswith((key + "[", key + ".")) or at == f"[{section}]":
                raise ConfigError(origin[key], exc.what) from None
        point = " ".join(overrides.label(k, v) for k, v in given.items())
        raise ConfigError(exc.where, f"{exc.what} (at the sweep point {point})") from None


def _source(path: Path, data: dict, grid_args: Sequence[str]) -> tuple[dict, Path, dict, list]:
    """The base scenario table, the path its relative paths resolve against, the file's grid
    (``section.key`` -> values) and its explicit points."""
    file = path.name
    if "scenario" in data:
        for name in data:
            if name not in SWEEP_KEYS:
                raise ConfigError(f"{file}: {name}", f"unknown sweep key; known: {', '.join(SWEEP_KEYS)}")
        base, base_path = data["scenario"], path
        if isinstance(base, str):
            base_path = (path.parent / base).resolve()
            base = load_raw(base_path)
        elif not isinstance(base, dict):
            raise ConfigError(f"{file}: scenario",
                              "give a scenario file's path or an inline [scenario] table")
        explicit = data.get("points", [])
        if not isinstance(explicit, list) or not all(isinstance(p, dict) for p in explicit):
            raise ConfigError(f"{file}: points", "must be a list of tables ([[points]])")
        return base, base_path, _flat(data.get("grid", {}), f"{file}: grid"), explicit
    if any(section in SCHEMA for section in data):
        if not grid_args:
            raise ConfigError(file, "a scenario file needs --grid section.key=v1,v2 to make a sweep "
                              "(or write a sweep file: docs/sweep.md)")
        return data, path, {}, []
    raise ConfigError(file, "neither a sweep file (no 'scenario' key) nor a scenario")


def load(path: Path, grid_args: Sequence[str] = (), repeats: int | None = None) -> Sweep:
    """Read a sweep file, or a scenario file with ``--grid`` axes; validate every point.

    Raises ConfigError naming the key (unknown key, empty value list, wrong type, ...).
    """
    data = load_raw(path, "sweep or scenario file")
    file = path.name
    base, base_path, grid, explicit = _source(path, data, grid_args)
    origin = {key: f"{file}: grid.{key}" for key in grid}  # where each key was set, for errors
    for spec in grid_args:
        section, name, values = overrides.parse(spec)
        key = f"{section}.{name}"
        if key in grid:
            raise ConfigError(f"--grid {key}", f"{file} already varies {key}")
        grid[key], origin[key] = values, f"--grid {key}"
    for key, values in grid.items():
        if not isinstance(values, list):
            raise ConfigError(origin[key], f"must be a list of values, got {values!r}")
        if not values:
            raise ConfigError(origin[key], "empty list of values")
    rows = [_flat(p, f"{file}: points[{i}]") for i, p in enumerate(explicit)] or [{}]
    for i, p in enumerate(rows):
        for key in p:
            if key in grid:
                raise ConfigError(f"{file}: points[{i}].{key}", f"the grid varies {key} already")
            origin.setdefault(key, f"{file}: points[{i}].{key}")
    where = "--repeats" if repeats is not None else f"{file}: repeats"
    if repeats is None:
        repeats = data.get("repeats", 1) if "scenario" in data else 1
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(where, f"must be a positive integer, got {repeats!r}")
    if repeats > 1 and "run.seed" in origin:
        raise ConfigError(where, "the sweep sets run.seed itself; give one or the other")
    origin.setdefault("run.seed", where)
    run_table = base.get("run")
    seed0 = run_table.get("seed", 0) if isinstance(run_table, dict) else 0
    seeds = [{"run.seed": seed0 + r} if repeats > 1 else {} for r in range(repeats)]
    combos = [{**p, **dict(zip(grid, values)), **s}
              for p in rows for values in itertools.product(*grid.values()) for s in seeds]
    return Sweep(base_path, *_points(base, base_path, grid, rows, combos, origin))


def _points(base: dict, base_path: Path, grid: dict, rows: list[dict], combos: list[dict],
            origin: dict) -> tuple[tuple[str, ...], tuple[Point, ...]]:
    """The table's key columns (the grid's, the explicit points', the seed) and the points,
    each named by its values of the keys that vary and validated."""
    keys = [k for k in dict.fromkeys([*grid, *(k for p in rows for k in p)]) if k != "run.seed"]
    keys.append("run.seed")
    shorts = [k.partition(".")[2] for k in keys]
    ambiguous = {s for s in shorts if shorts.count(s) > 1}
    varying = [k for k in keys if len({json.dumps(c.get(k)) for c in combos}) > 1]
    points: list[Point] = []
    taken: set[str] = set()
    for given in combos:
        raw = base
        for key, value in given.items():
            section, _, name = key.partition(".")
            raw = overrides.apply(raw, section, name, value)
        name = _name([_label(k, given[k], ambiguous) for k in keys if k in varying and k in given], taken)
        points.append(Point(name, given, raw, _check_point(raw, base_path, given, origin)))
    return tuple(keys), tuple(points)


# -- running -----------------------------------------------------------------------------


def run_point(raw: dict, path: str) -> tuple[str, object]:
    """Run one point; ``("ok", files)`` or ``("error", (where, what))`` (picklable either way)."""
    from kvsim import engine, metrics
    from kvsim.workload import build_requests

    try:
        sc = parse_scenario(raw, Path(path))
        rec = engine.run(sc, build_requests(sc))
        return "ok", metrics.result_files(sc, rec, metrics.summarize(sc, rec))
    except ConfigError as exc:
        return "error", (exc.where, exc.what)


def _local(tasks: list[tuple[dict, str]], workers: int) -> Generator[tuple[int, tuple], None, None]:
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    pool = ProcessPoolExecutor(max_workers=min(workers, len(tasks)))
    try:
        futures = {pool.submit(run_point, *t): i for i, t in enumerate(tasks)}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in done:
                yield futures[f], f.result()
    finally:
        # On an error or Ctrl-C: drop the points not started; those running are not waited for.
        pool.shutdown(wait=False, cancel_futures=True)


def require_backend(backend: str) -> None:
    """Refuse a backend whose package is not installed (before any folder is made)."""
    if backend == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ConfigError("--backend ray", "Ray is not installed: pip install 'kvsim[ray]'") from None


def _ray(tasks: list[tuple[dict, str]], workers: int,
         address: str | None) -> Generator[tuple[int, tuple], None, None]:
    require_backend("ray")
    import ray

    import kvsim

    if address:
        # A cluster's workers get this kvsim's code (they need its dependencies installed).
        ray.init(address=address, runtime_env={"py_modules": [os.path.dirname(kvsim.__file__)]},
                 log_to_driver=False, logging_level=logging.ERROR)
    else:
        ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.ERROR)
    try:
        remote = ray.remote(num_cpus=1)(run_point)
        refs = {remote.remote(*t): i for i, t in enumerate(tasks)}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            yield refs[done[0]], ray.get(done[0])
    finally:
        ray.shutdown()


BACKENDS = {"local": lambda tasks, workers, address: _local(tasks, workers), "ray": _ray}


def is_complete(folder: Path, point: Point) -> bool:
    """Whether ``folder`` holds this point's finished run (same resolved scenario)."""
    try:
        return ((folder / "summary.json").is_file()
                and (folder / "scenario.resolved.toml").read_text(encoding="utf-8") == point.resolved)
    except OSError:
        return False


def run(sweep: Sweep, out: Path, backend: str = "local", workers: int | None = None,
        address: str | None = None,
        progress: Callable[[int, int, int], None] | None = None) -> list[dict]:
    """Run the points not yet complete under ``out/points``; write ``sweep.csv``; return its rows.
    ``progress(done, total, done_before)`` is told of every finished point.

    Raises ConfigError when ``out`` is something else than a sweep folder, or a point fails.
    """
    if out.exists() and not (out / "sweep.json").is_file() and any(out.iterdir()):
        raise ConfigError(str(out), "exists and is not a kvsim sweep folder; choose another --out")
    (out / "points").mkdir(parents=True, exist_ok=True)
    (out / "sweep.csv").unlink(missing_ok=True)
    for partial in (out / "points").iterdir():  # left by a killed sweep
        if is_partial(partial):
            shutil.rmtree(partial, ignore_errors=True)
    write_file(out / "sweep.json", json.dumps({
        "keys": list(sweep.keys),
        "points": [{"name": p.name, "overrides": p.overrides} for p in sweep.points],
    }, indent=2) + "\n")
    todo = [p for p in sweep.points if not is_complete(out / "points" / p.name, p)]
    skipped = done = len(sweep.points) - len(todo)
    if progress:
        progress(done, len(sweep.points), skipped)
    if todo:
        tasks = [(p.raw, str(sweep.path)) for p in todo]
        results = BACKENDS[backend](tasks, workers or os.cpu_count() or 1, address)
        try:
            for i, (status, value) in results:
                if status == "error":
                    where, what = value
                    raise ConfigError(where, f"{what} (at the sweep point {todo[i].name})")
                write_results(out / "points" / todo[i].name, value, replace=True)
                done += 1
                if progress:
                    progress(done, len(sweep.points), skipped)
        finally:
            results.close()
    rows = table_rows(sweep, out)
    write_file(out / "sweep.csv", compare.csv_text(rows, ("point", *sweep.keys, *compare.COLUMNS[1:])))
    return rows


def _cell(value):
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | dict):
        return json.dumps(value)
    return value


def table_rows(sweep: Sweep, out: Path) -> list[dict]:
    """One row per point: ``point``, the overridden keys (resolved where a point leaves one out),
    then ``compare.row``'s headline metrics from the point's summary.json."""
    rows = []
    for p in sweep.points:
        folder = out / "points" / p.name
        summary = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
        resolved = tomllib.loads(p.resolved)
        cells = {}
        for key in sweep.keys:
            section, _, name = key.partition(".")
            cells[key] = _cell(p.overrides[key] if key in p.overrides
                               else resolved.get(section, {}).get(name))
        metrics = compare.row(p.name, summary)
        rows.append({"point": p.name, **cells, **{k: v for k, v in metrics.items() if k != "variant"}})
    return rows
