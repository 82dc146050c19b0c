"""vLLM's OpenAI-compatible server for one model folder, run from the engine venv, on loopback, always stopped.

The project's venv cannot import vLLM's CPU build (it pins its own torch and transformers), so the server
is a separate process from `vllm_python()`'s interpreter, in a process group of its own; leaving the
context manager, by return or by exception, stops the whole group (TERM, then KILL). It binds 127.0.0.1
only, on a port that was free a moment before. Timing is what it is served for, so the prefix cache is
off, and the KV cache gets a stated size (VLLM_CPU_KVCACHE_SPACE) rather than a share of free memory.

    with VllmServer(folder, ServerSettings(max_model_len=2050)) as server:
        server.completions_url   # http://127.0.0.1:PORT/v1/completions, model name server.model

Failures are one line naming vLLM (VllmError); with --debug the server's last log lines go to stderr.
Its log goes to a temporary file, removed when the server stops.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from prunetool.errors import PrunetoolError
from prunetool.serving.engines import SETUP_HINT, VLLM_VERSION, vllm_python

START_SECONDS = 600  # the longest wait for /health; a start on this 2-core machine takes 1-2 minutes
STOP_SECONDS = 30  # TERM, then KILL the group after this
LOG_LINES = 40  # shown under --debug when the server fails
SERVED_NAME = "model"  # the name requests use (`model` in the OpenAI API)


class VllmError(PrunetoolError):
    """vLLM could not be started, could not load the folder, or stopped answering."""


@dataclass(frozen=True)
class ServerSettings:
    dtype: str = "float32"  # vLLM's CPU build: float32 or bfloat16
    max_model_len: int = 2048
    kv_cache_gib: int = 2  # VLLM_CPU_KVCACHE_SPACE (whole GiB; vLLM reads an int): the KV cache, fixed up front
    trust_remote_code: bool | None = None  # None: on exactly for nemotron-nas (DeciLM) folders
    tensor_parallel: int = 1
    max_num_seqs: int | None = None  # vLLM's default (256) when None
    extra_env: dict = field(default_factory=dict)

    def describe(self) -> dict:
        return {"dtype": self.dtype, "max_model_len": self.max_model_len, "kv_cache_space_gib": self.kv_cache_gib,
                "prefix_caching": False, "enforce_eager": True}


def needs_remote_code(folder: Path) -> bool:
    """A nemotron-nas folder: transformers < 5.20 has no config class for it, so vLLM reads the folder's own."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return config.get("model_type") == "nemotron-nas" or "auto_map" in config


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def debugging() -> bool:
    return os.environ.get("PRUNETOOL_DEBUG", "") not in ("", "0")


class VllmServer:
    """One `vllm.entrypoints.openai.api_server` for `folder`; a context manager that always stops it."""

    def __init__(self, folder: Path | str, settings: ServerSettings = ServerSettings(), *,
                 python: Path | None = None, start_seconds: float = START_SECONDS):
        self.folder = Path(folder)
        self.settings = settings
        self.python = python or vllm_python()
        if self.python is None:
            raise VllmError(f"vLLM's CPU build is not set up: {SETUP_HINT}")
        self.start_seconds = start_seconds
        self.trust_remote_code = (needs_remote_code(self.folder) if settings.trust_remote_code is None
                                  else settings.trust_remote_code)
        self.port: int | None = None
        self.process: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self.version = VLLM_VERSION
        self.start_seconds_taken: float | None = None

    # ------------------------------------------------------------------ addresses

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def completions_url(self) -> str:
        return f"{self.base_url}/v1/completions"

    model = SERVED_NAME

    # ------------------------------------------------------------------ start and stop

    def command(self) -> list[str]:
        s = self.settings
        command = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.folder),
                   "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(self.port),
                   "--dtype", s.dtype, "--max-model-len", str(s.max_model_len), "--no-enable-prefix-caching",
                   "--enforce-eager",  # torch.compile costs minutes per start on this CPU
                   "--disable-uvicorn-access-log", "--generation-config", "vllm"]
        if s.tensor_parallel > 1:
            command += ["--tensor-parallel-size", str(s.tensor_parallel)]
        if s.max_num_seqs is not None:
            command += ["--max-num-seqs", str(s.max_num_seqs)]
        if self.trust_remote_code:
            command.append("--trust-remote-code")
        return command

    def environment(self) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME",
                                                                                "VIRTUAL_ENV")}
        env |= {"VLLM_CPU_KVCACHE_SPACE": str(int(self.settings.kv_cache_gib)), "HF_HUB_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}
        return env | {key: str(value) for key, value in self.settings.extra_env.items()}

    def start(self) -> "VllmServer":
        if not (self.folder / "config.json").is_file():
            raise VllmError(f"vLLM needs a model folder with config.json; {self.folder} has none")
        for attempt in range(3):  # the free port may be taken between the probe and the bind
            self._launch()
            try:
                self._wait_ready()
                return self
            except _PortTaken:
                self.stop()
            except BaseException:  # Ctrl-C while waiting: __exit__ will not run, so stop it here
                self.stop()
                raise
        raise VllmError("vLLM could not bind a free port on 127.0.0.1 (three tries)")

    def _launch(self) -> None:
        self.port = free_port()
        handle, name = tempfile.mkstemp(prefix="prunetool-vllm-", suffix=".log")
        self.log_path = Path(name)
        with os.fdopen(handle, "wb") as log:
            # Its own session, so that stop() ends the whole group; no preexec_fn (a fork of this threaded
            # process must run no Python). util-linux's setpriv, where present, asks the kernel to TERM the
            # server if prunetool dies without stopping it (vLLM's engine processes follow their parent).
            setpriv = shutil.which("setpriv")
            guard = [setpriv, "--pdeathsig", "TERM", "--"] if setpriv and sys.platform == "linux" else []
            self.process = subprocess.Popen(guard + self.command(), stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, env=self.environment(),
                                            cwd=tempfile.gettempdir(), start_new_session=True)
        self._started = time.perf_counter()

    def _wait_ready(self) -> None:
        deadline = self._started + self.start_seconds
        while True:
            code = self.process.poll()
            if code is not None:
                reason = self.failure_reason()
                if "address already in use" in reason.lower():
                    raise _PortTaken()
                self.show_log()
                self.stop()
                raise VllmError(f"vLLM could not serve {self.folder} (exit {code}): {reason}")
            if self.healthy():
                self.start_seconds_taken = time.perf_counter() - self._started
                self.version = self.get_json("/version").get("version", VLLM_VERSION)
                return
            if time.perf_counter() > deadline:
                self.show_log()
                self.stop()
                raise VllmError(f"vLLM did not become ready for {self.folder} within {self.start_seconds:.0f} s")
            time.sleep(0.5)

    def healthy(self) -> bool:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            connection.request("GET", "/health")
            return connection.getresponse().status == 200
        except OSError:
            return False
        finally:
            connection.close()

    def get_json(self, path: str) -> dict:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            connection.request("GET", path)
            response = connection.getresponse()
            return json.loads(response.read() or b"{}") if response.status == 200 else {}
        except (OSError, ValueError):
            return {}
        finally:
            connection.close()

    def failure(self, error: BaseException) -> VllmError:
        """What to raise when a request to this server failed with `error`: one line naming vLLM, with the reason
        vLLM logged (an exception in its engine) where it logged one, else the client's error."""
        reason = self.failure_reason(default=None)
        if reason is None:
            reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        self.show_log()
        if self.process is not None and self.process.poll() is not None:
            return VllmError(f"vLLM stopped while serving {self.folder} (exit {self.process.returncode}): {reason}")
        return VllmError(f"vLLM failed a request for {self.folder}: {reason}")

    def stop(self) -> None:
        """Stop the server's whole process group: TERM, then KILL after STOP_SECONDS; remove the log."""
        process, self.process = self.process, None
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=STOP_SECONDS)
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError):  # engine processes that outlived the API server
                os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=STOP_SECONDS)
        if self.log_path is not None and not debugging():
            with contextlib.suppress(OSError):
                self.log_path.unlink()
        self.log_path = None

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ the log

    def log_tail(self, lines: int = LOG_LINES) -> list[str]:
        if self.log_path is None or not self.log_path.is_file():
            return []
        return self.log_path.read_text(errors="replace").splitlines()[-lines:]

    def failure_reason(self, default: str | None = "") -> str | None:
        """The last exception line of the log (vLLM prints tracebacks from several processes), shortened; where
        there is none, `default`, or with the default "" the log's last line."""
        lines = [LOG_PREFIX.sub("", line).strip() for line in self.log_tail(400)]
        errors = [line for line in lines if ERROR_LINE.match(line)]
        causes = [line for line in errors if not WRAPPER.search(line)]  # a traceback prints its root cause first
        if not errors and default != "":
            return default
        if causes:
            reason = causes[0]
            following = lines[lines.index(reason) + 1:][:1]
            if PYDANTIC.search(reason) and following:  # the message is on the next line
                reason = following[0].removeprefix("Value error, ")
        else:
            reason = errors[-1] if errors else next((line for line in reversed(lines) if line), "no output")
        if len(reason) > 300:  # e.g. vLLM's list of every architecture it supports: the first sentence
            reason = re.split(r"(?<=[.!?]) ", reason)[0]
        return reason if len(reason) <= 300 else reason[:297] + "..."

    def show_log(self) -> None:
        if debugging():
            tail = self.log_tail()
            print(f"--- last {len(tail)} lines of vLLM's log ({self.log_path}) ---", *tail, "---", sep="\n",
                  file=sys.stderr)


# "(EngineCore pid=12) ERROR 12-07 19:40:16 [v1/engine/core.py:1512] " before a line; INFO/DEBUG/WARNING lines
# are dropped whole (they mention errors vLLM handled)
LOG_PREFIX = re.compile(r"^(\(\w+ pid=\d+\)\s*)?(ERROR \d\d-\d\d [\d:]+ \[[^\]]*\]\s*)?")
ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception|Exit|Interrupt)\b.*?:")
PYDANTIC = re.compile(r"ValidationError: \d+ validation errors? for ")
WRAPPER = re.compile(r"EngineDeadError|EngineGenerateError|initialization failed|root cause|stack trace above")


class _PortTaken(Exception):
    pass

