"""llama.cpp's own C++ programs, built by benchmarks/build_llama_server.sh from the same
llama.cpp sources Sokuji's llama-cpp-python wheel was built from: finding them, and running
``llama-server`` as a benchmark peer pinned to the server core."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
from pathlib import Path

from _harness import ROOT, Server


def llama_cpp_python_version() -> str:
    return importlib.metadata.version("llama-cpp-python")


def tools_bin_dir() -> Path:
    """Where build_llama_server.sh puts the binaries for the installed llama-cpp-python."""
    base = Path(os.environ.get("SOKUJI_TOOLS_DIR") or ROOT / ".cache" / "tools")
    return base / f"llama-cpp-{llama_cpp_python_version()}" / "build" / "bin"


def find_tool(name: str, explicit: str | None = None) -> Path:
    """The path of llama.cpp program ``name`` (``explicit`` if given), or exit saying how to
    build it."""
    path = Path(explicit) if explicit else tools_bin_dir() / name
    if path.is_file() and os.access(path, os.X_OK):
        return path
    raise SystemExit(
        f"{name} not found at {path}.\n"
        "Build it from the llama.cpp sources of the installed llama-cpp-python "
        f"({llama_cpp_python_version()}; 4-13 min on 2 cores):\n"
        "    benchmarks/build_llama_server.sh\n"
        "(it builds into $SOKUJI_TOOLS_DIR, default .cache/tools; set the same variable here),"
        f" or pass the binary's path with --{name}.")


def tool_version(path: Path) -> str:
    done = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=30,
                          check=False)
    return (done.stdout + done.stderr).strip()


class LlamaServer(Server):
    """``llama-server`` on the server core with continuous batching over ``slots`` slots of
    ``ctx_per_slot`` cells each (one KV stream per slot, as Sokuji's engine: with an explicit
    ``-np`` llama-server does not unify the cache), flash attention on, no web UI. Its log
    (a few lines per request) goes to ``log_path``."""

    def __init__(self, args: argparse.Namespace, binary: Path, gguf: Path, port: int,
                 slots: int, ctx_per_slot: int, log_path: Path) -> None:
        self.argv = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                     "-t", str(args.threads), "-tb", str(args.threads),
                     "-np", str(slots), "-cb", "-c", str(slots * ctx_per_slot),
                     "-fa", "on", "--no-webui"]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        # exec: the shell only redirects; SIGTERM then reaches llama-server itself
        super().__init__(args, ["sh", "-c", f'exec "$0" "$@" >"{log_path}" 2>&1', *self.argv],
                         port, ready_path="/health")
