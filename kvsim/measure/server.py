"""``kvsim validate --against vllm-server``: a scenario replayed into an OpenAI-compatible vLLM server.

With ``--url`` the server is the user's (e.g. a GPU deployment); without it kvsim starts one on
127.0.0.1 from the engine environment (``make_engine_env.sh``) with the scenario's engine
settings, and stops it (its whole process group) however the run ends. Each request is a
streaming ``/v1/completions`` call with the prompt as token ids, sent from its own thread at
its arrival time (open loop). Measured per request, on this client's clock: TTFT = first
streamed token − scheduled arrival, E2E = last token − scheduled arrival; cached tokens from
``usage.prompt_tokens_details.cached_tokens`` (the server needs
``--enable-prompt-tokens-details``); the prefix-cache counters and the KV block count from
``/metrics``. The server's steps cannot be timed from outside, so kvsim predicts with a given
cost profile (``--profile``, e.g. the ``profile.json`` a ``--against vllm-engine`` run wrote).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from kvsim.errors import ConfigError
from kvsim.measure import engine

START_TIMEOUT_S = 240.0
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")


class Server:
    """A vLLM API server started from the engine environment; ``stop`` ends its process group."""

    def __init__(self, python: Path, model: Path, sc, port: int, log_path: Path):
        e, s = sc.engine, sc.speculative
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init",
               "--enable-prompt-tokens-details", "--enforce-eager", "--seed", "0",
               "--block-size", str(e.block_size), "--max-num-seqs", str(e.max_num_seqs),
               "--max-num-batched-tokens", str(e.max_num_batched_tokens),
               "--max-model-len", str(e.max_model_len),
               "--enable-prefix-caching" if e.enable_prefix_caching else "--no-enable-prefix-caching",
               "--async-scheduling" if e.async_scheduling else "--no-async-scheduling"]
        if not e.num_gpu_blocks_derived:
            cmd += ["--num-gpu-blocks-override", str(e.num_gpu_blocks)]
        if e.long_prefill_token_threshold:
            cmd += ["--long-prefill-token-threshold", str(e.long_prefill_token_threshold)]
        if s.enabled:
            spec = {"method": s.method, "num_speculative_tokens": s.num_speculative_tokens}
            if s.method != "ngram":
                spec["model"] = str(_draft_folder(python, model, s.method))
                cmd += ["--load-format", "dummy"]
            cmd += ["--speculative-config", json.dumps(spec)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1"}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        with open(log_path, "w") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def last_log_line(self) -> str:
        lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        errors = [ln for ln in lines if "Error" in ln or "error" in ln]
        return (errors or lines or ["no output"])[-1].strip()[:300]

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ConfigError("vllm-server", f"the server exited during start-up (status "
                                  f"{self.proc.returncode}): {self.last_log_line()}")
            try:
                status, _ = _get(self.url, "/health", 2.0)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise ConfigError("vllm-server", f"the server was not healthy within {timeout_s:.0f} s: "
                          f"{self.last_log_line()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        # Workers the server spawned share its process group: make sure none is left.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def _draft_folder(python: Path, model: Path, method: str) -> Path:
    out = subprocess.run([str(python), "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                          "import engine_driver as d; from pathlib import Path; "
                          "print(d.draft_folder(Path(sys.argv[2]), sys.argv[3]))",
                          str(engine.DRIVER.parent), str(model), method],
                         capture_output=True, text=True)
    if out.returncode:
        raise ConfigError("vllm-server", f"cannot write the {method} drafter's config: "
                          f"{(out.stderr.strip().splitlines() or ['?'])[-1]}")
    return Path(out.stdout.strip())


def check_url(url: str):
    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ConfigError("--url", f"expected http://HOST:PORT, got {url!r}")
    return u


def _conn(url: str, timeout_s: float) -> http.client.HTTPConnection:
    u = check_url(url)
    cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    return cls(u.hostname, u.port, timeout=timeout_s)


def _get(url: str, path: str, timeout_s: float) -> tuple[int, str]:
    c = _conn(url, timeout_s)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read().decode("utf-8", "replace")
    finally:
        c.close()


def _post(url: str, path: str, body: dict | None, timeout_s: float) -> tuple[int, str]:
    c = _conn(url, timeout_s)
    try:
        c.request("POST", path, body=json.dumps(body or {}),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read().decode("utf-8", "replace")
    finally:
        c.close()


def scrape(url: str) -> tuple[dict[str, float], dict[str, str]]:
    """``/metrics``: counter totals (``_total`` dropped, summed over label sets) and the labels
    of ``vllm:cache_config_info``."""
    try:
        status, text = _get(url, "/metrics", 10.0)
    except OSError as exc:
        raise ConfigError("vllm-server", f"cannot read {url}/metrics: {exc}") from None
    if status != 200:
        raise ConfigError("vllm-server", f"{url}/metrics answered HTTP {status}")
    counters: dict[str, float] = {}
    info: dict[str, str] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.groups()
        if name == "vllm:cache_config_info" and labels:
            info = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        elif name.endswith("_total"):
            key = name[: -len("_total")]
            counters[key] = counters.get(key, 0.0) + float(value)
    return counters, info


def complete(url: str, model: str, req: dict, timeout_s: float, t0: float) -> dict:
    """One streaming completion; times on ``time.monotonic`` relative to ``t0``."""
    body = {"model": model, "prompt": req["prompt_token_ids"], "max_tokens": req["max_tokens"],
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    c = _conn(url, timeout_s)
    out: dict = {"num_output_tokens": 0}
    try:
        c.request("POST", "/v1/completions", body=json.dumps(body),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            detail = r.read().decode("utf-8", "replace").strip().replace("\n", " ")[:200]
            raise ConfigError("vllm-server", f"request {req['req_id']} failed: HTTP {r.status} {detail}")
        for raw in r:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            err = chunk.get("error")
            if err:
                if isinstance(err, dict):
                    err = f"{err.get('type', 'error')} {err.get('code', '')}: {err.get('message', '')}"
                raise ConfigError("vllm-server", f"request {req['req_id']} failed: {err}")
            now = time.monotonic() - t0
            if chunk.get("choices"):
                out.setdefault("first_token_s", now)
                out["finish_s"] = now
            usage = chunk.get("usage")
            if usage:
                out["num_output_tokens"] = usage.get("completion_tokens", 0)
                details = usage.get("prompt_tokens_details") or {}
                out["num_cached_tokens"] = details.get("cached_tokens")
    except OSError as exc:
        raise ConfigError("vllm-server", f"request {req['req_id']} failed: {exc}") from None
    finally:
        c.close()
    if out.get("num_cached_tokens") is None:
        raise ConfigError("vllm-server", "the server reports no usage.prompt_tokens_details."
                          "cached_tokens (start it with --enable-prompt-tokens-details)")
    return out


def replay(url: str, model: str, requests: list[dict], timeout_s: float) -> dict[str, dict]:
    """Every request from its own thread at its arrival time. Raises the first failure."""
    results: dict[str, dict] = {}
    errors: list[BaseException] = []
    t0 = time.monotonic() + 0.5

    def one(req):
        try:
            time.sleep(max(0.0, t0 + req["arrival_s"] - time.monotonic()))
            results[req["req_id"]] = complete(url, model, req, timeout_s, t0)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        exc = errors[0]
        if isinstance(exc, ConfigError):
            raise exc
        raise ConfigError("vllm-server", f"a request failed: {type(exc).__name__}: {exc}")
    return results


def port_free(port: int) -> bool:
    """Nothing listens on ``port`` (connections of a stopped server may linger in TIME_WAIT;
    a server binds over those, as vLLM's does with SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def measure(url: str, sc, replay_reqs: list[dict], timeout_s: float, log=None) -> dict:
    """Warm up, reset the prefix cache if the server allows it, replay; the measured phase."""
    status, text = _get(url, "/v1/models", 10.0)
    if status != 200:
        raise ConfigError("vllm-server", f"{url}/v1/models answered HTTP {status}")
    model = json.loads(text)["data"][0]["id"]
    vocab = sc.model.vocab_size
    warm = {"req_id": "warm-up", "prompt_token_ids": list(range(vocab - 300, vocab)),
            "max_tokens": 8, "arrival_s": 0.0}
    replay(url, model, [warm], timeout_s)
    status, _ = _post(url, "/reset_prefix_cache", None, 30.0)
    if status != 200 and log:
        log(f"note: {url} did not reset its prefix cache (HTTP {status}; a server started with "
            "VLLM_SERVER_DEV_MODE=1 does): hits from earlier requests may show")
    before, _ = scrape(url)
    results = replay(url, model, replay_reqs, timeout_s)
    after, info = scrape(url)
    return {"requests": results, "counters": {k: after[k] - before.get(k, 0.0) for k in after},
            "cache_config": info}


def validate(path: Path, url: str | None, profile: str | None, python: str | None, port: int,
             timeout_s: float, log=None) -> dict:
    from kvsim.cost.fitted import check_matches, load_profile, resolve_profile

    if url is not None:
        check_url(url)
    raw, sc, specs, replay_reqs = engine.prepare(path, local=url is None)
    if profile or sc.cost.profile:
        ppath = resolve_profile(profile, None) if profile else Path(sc.cost.profile)
        prof = load_profile(ppath)
        check_matches(prof, sc.model, sc.engine.tensor_parallel_size, "--profile")
    else:
        raise ConfigError("--profile", "a server's steps cannot be timed from outside: give a cost "
                          "profile (a vllm-engine run writes profile.json) or set cost.profile")
    server = None
    try:
        if url is None:
            if not port_free(port):
                raise ConfigError("--port", f"127.0.0.1:{port} is in use; pick another --port")
            py = engine.engine_python(python)
            shape = engine.model_shape(sc)
            made = subprocess.run([str(py), str(engine.DRIVER), "--make-model", json.dumps(shape),
                                   str(engine.model_dir(shape))], capture_output=True, text=True)
            if made.returncode:
                raise ConfigError("vllm-server", "cannot build the model checkpoint: "
                                  f"{(made.stderr.strip().splitlines() or ['?'])[-1]}")
            log_path = Path(tempfile.mkstemp(prefix="kvsim-vllm-server-", suffix=".log")[1])
            if log:
                log(f"starting a vLLM server on 127.0.0.1:{port} (log {log_path})")
            server = Server(py, Path(made.stdout.strip()), sc, port, log_path)
            server.wait_healthy(min(START_TIMEOUT_S, timeout_s))
            url = server.url
        if log:
            log(f"replaying {len(replay_reqs)} requests into {url}")
        phase = measure(url.rstrip("/"), sc, replay_reqs, timeout_s, log)
    finally:
        if server is not None:
            server.stop()
    if server is not None:
        server.log_path.unlink()  # kept (and named at start) only when the run failed
    info = phase["cache_config"]
    e = sc.engine
    resolved = {"vllm_version": e.vllm_version,
                "num_gpu_blocks": int(info.get("num_gpu_blocks") or e.num_gpu_blocks),
                "block_size": int(info.get("block_size") or e.block_size),
                "async_scheduling": e.async_scheduling,
                **{k: getattr(e, k) for k in engine.ENGINE_KEYS if k != "block_size"}}
    out = engine.predict_and_compare(raw, path, specs, engine.measured_records(specs, phase),
                                     resolved, prof, phase["counters"])
    out["url"] = url
    out["profile_note"] = f"{ppath} (given)"
    return out
