"""Mutation testing (mutmut) over the modules where a wrong answer is silent.

Each group mutates one or a few modules and runs only the unit tests that cover them, in a
scratch directory of its own (``.cache/mutation/<group>/``: links to ``sokuji/`` and
``tests/``, and a pyproject.toml with the group's ``[tool.mutmut]``), so groups never share
mutmut's ``mutants/`` tree or its results. Every module of ``sokuji/`` outside the group is
copied unmutated.

    python benchmarks/mutation.py                 # every group (long: see docs/mutation.md)
    python benchmarks/mutation.py --quick         # the fixed short subset (about a minute)
    python benchmarks/mutation.py core/forming server/auth --max-children 2

Writes ``benchmarks/results/mutation/scores.json`` and ``scores.md`` (per module: killed,
survived, timeout, no tests, score = killed+timeout over those with tests) and lists every
survivor by its mutmut name (``mutmut show NAME`` in the group's directory prints its diff).
Each group runs under ``--group-timeout`` seconds (wall clock); a group cut short is marked so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRATCH = ROOT / ".cache" / "mutation"
RESULTS = ROOT / "benchmarks" / "results" / "mutation"
U = "tests/unit/"


@dataclass(frozen=True)
class Group:
    modules: tuple[str, ...]
    tests: tuple[str, ...]


GROUPS: dict[str, Group] = {
    "core/forming": Group(("sokuji/core/forming.py",),
                          (U + "test_forming_order.py", U + "test_forming_groups.py",
                           U + "test_forming_mutants.py")),
    "core/cache": Group(("sokuji/core/cache.py",),
                        (U + "test_cache_and_auth.py", U + "test_cache_failures.py",
                         U + "test_cache_key_mutants.py", U + "test_cache_coalescing_mutants.py")),
    "server/auth": Group(("sokuji/server/auth.py",),
                         (U + "test_cache_and_auth.py", U + "test_app_auth_failures.py",
                          U + "test_auth_mutants.py")),
    "core/policy": Group(("sokuji/core/policy.py",),
                         (U + "test_policy.py", U + "test_policy_mutants.py")),
    "core/slo_admission": Group(("sokuji/core/slo_admission.py",), (U + "test_slo.py",)),
    "core/batcher": Group(("sokuji/core/batcher.py",),
                          (U + "test_batcher.py", U + "test_batcher_inline.py")),
    "llm/sampling": Group(("sokuji/llm/sampling.py",),
                          (U + "test_llm_sampling.py", U + "test_sampling_mutants.py")),
    "llm/sequence": Group(("sokuji/llm/sequence.py",),
                          (U + "test_llm_sampling.py", U + "test_llm_speculative.py",
                           U + "test_llm_engine_split.py")),
    "llm/prefix_cache": Group(("sokuji/llm/prefix_cache.py",),
                              (U + "test_llm_units.py", U + "test_prefix_cache_mutants.py")),
    "llm/speculative": Group(("sokuji/llm/speculative.py",), (U + "test_llm_speculative.py",)),
    "routing/breaker": Group(("sokuji/routing/breaker.py",), (U + "test_breaker.py",)),
    "routing/canary": Group(("sokuji/routing/canary.py",), (U + "test_canary.py",)),
    "routing/submission": Group(("sokuji/routing/submission.py",),
                                (U + "test_router_cascade.py",)),
    "routing/router": Group(("sokuji/routing/router.py",),
                            (U + "test_router.py", U + "test_router_cascade.py")),
}
# The fixed subset `make mutation-quick` runs (pure modules with fast tests).
QUICK = ("core/forming", "server/auth")


def _pyproject(group: Group) -> str:
    """The repository's pyproject.toml (pytest's settings) with the group's [tool.mutmut]."""
    text = (ROOT / "pyproject.toml").read_text()
    tests = [t for t in group.tests if (ROOT / t).exists()]
    return (text + "\n[tool.mutmut]\n"
            'source_paths = ["sokuji/"]\n'
            f"only_mutate = {json.dumps(list(group.modules))}\n"
            f"pytest_add_cli_args_test_selection = {json.dumps(tests)}\n"
            'pytest_add_cli_args = ["-p", "no:cacheprovider"]\n')


def _prepare(name: str, group: Group) -> Path:
    work = SCRATCH / name.replace("/", "__")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for link in ("sokuji", "tests"):
        (work / link).symlink_to(ROOT / link)
    (work / "pyproject.toml").write_text(_pyproject(group))
    return work


def _results(work: Path) -> dict[str, int]:
    """Exit code per mutant, from mutmut's own records (mutants/**/*.py.meta)."""
    codes: dict[str, int] = {}
    for meta in (work / "mutants").rglob("*.py.meta"):
        try:
            data = json.loads(meta.read_text())
        except ValueError:  # being written: counted at the next look
            continue
        codes.update(data.get("exit_code_by_key", {}))
    return codes


def _status(code: int | None) -> str:
    from mutmut.stats import status_by_exit_code
    return "not checked" if code is None else status_by_exit_code.get(code, f"exit {code}")


def run_group(name: str, group: Group, *, max_children: int, timeout_s: float) -> dict:
    work = _prepare(name, group)
    # The unmutated tree must not be importable ahead of mutants/: drop the checkout itself.
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and Path(p).resolve() != ROOT]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    # One MiniLM export per checkout, not one per group (tests/conftest.py's cache).
    env.setdefault("SOKUJI_TEST_CACHE_DIR", str(ROOT / ".cache" / "sokuji"))
    cmd = [sys.executable, "-m", "mutmut", "run", "--max-children", str(max_children)]
    print(f"== {name}: {', '.join(group.modules)} ({len(group.tests)} test files)", flush=True)
    start = time.monotonic()
    cut = False
    log = (work / "mutmut.log").open("w")
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        while proc.poll() is None:
            elapsed = time.monotonic() - start
            if elapsed > timeout_s:
                cut = True
                break
            done = _results(work) if (work / "mutants").exists() else {}
            checked = sum(c is not None for c in done.values())
            print(f"\r   {elapsed:5.0f} s  {checked}/{len(done)} mutants checked", end="",
                  flush=True)
            time.sleep(2)
    finally:
        if proc.poll() is None:  # cut short, or this driver interrupted: mutmut's workers too
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
        log.close()
    print()
    codes = _results(work)
    counts: dict[str, int] = {}
    for code in codes.values():
        status = _status(code)
        counts[status] = counts.get(status, 0) + 1
    killed = counts.get("killed", 0) + counts.get("timeout", 0) + counts.get("segfault", 0)
    tested = killed + counts.get("survived", 0) + counts.get("suspicious", 0)
    survivors = sorted(k for k, c in codes.items() if _status(c) in ("survived", "suspicious"))
    untested = sorted(k for k, c in codes.items() if _status(c) == "no tests")
    row = {"group": name, "modules": list(group.modules), "tests": list(group.tests),
           "mutants": len(codes), "counts": counts, "score": killed / tested if tested else None,
           "survivors": survivors, "no_tests": untested, "cut_short": cut,
           "exit_code": proc.returncode, "wall_s": round(time.monotonic() - start, 1),
           "workdir": str(work.relative_to(ROOT))}
    score = "n/a" if row["score"] is None else f"{100 * row['score']:.1f}%"
    print(f"   {len(codes)} mutants, {counts}, score {score}"
          + (" (cut short)" if cut else ""), flush=True)
    if proc.returncode not in (0, None) and not cut and not codes:
        print(f"   mutmut failed: see {work / 'mutmut.log'}", flush=True)
    return row


def table(rows: list[dict]) -> str:
    lines = ["| module | mutants | killed | timeout | survived | no tests | score | wall s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        c = r["counts"]
        score = "n/a" if r["score"] is None else f"{100 * r['score']:.1f}%"
        lines.append(f"| `{', '.join(r['modules'])}`{' (cut short)' if r['cut_short'] else ''}"
                     f" | {r['mutants']} | {c.get('killed', 0)} | {c.get('timeout', 0)}"
                     f" | {c.get('survived', 0) + c.get('suspicious', 0)}"
                     f" | {c.get('no tests', 0)} | {score} | {r['wall_s']:.0f} |")
    for r in rows:
        if r["survivors"]:
            lines += ["", f"Survivors in `{r['group']}` (`mutmut show NAME` in {r['workdir']}):"]
            lines += [f"- `{s}`" for s in r["survivors"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("groups", nargs="*", help=f"groups to run (default: all): {', '.join(GROUPS)}")
    ap.add_argument("--quick", action="store_true", help=f"the fixed subset: {', '.join(QUICK)}")
    ap.add_argument("--max-children", type=int, default=2)
    ap.add_argument("--group-timeout", type=float, default=900.0, help="seconds per group")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    names = list(QUICK) if args.quick else (args.groups or list(GROUPS))
    unknown = [n for n in names if n not in GROUPS]
    if unknown:
        ap.error(f"unknown group(s) {unknown}; known: {', '.join(GROUPS)}")
    try:
        import mutmut
    except ImportError:
        sys.exit("mutmut is not installed: `make mutation` installs it")
    rows = [run_group(n, GROUPS[n], max_children=args.max_children,
                      timeout_s=args.group_timeout) for n in names]
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"mutmut": mutmut.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "command": " ".join([Path(sys.executable).name, *sys.argv]), "groups": rows}
    (args.out / "scores.json").write_text(json.dumps(doc, indent=2) + "\n")
    (args.out / "scores.md").write_text(table(rows))
    print(table(rows))
    print(f"wrote {args.out / 'scores.json'} and {args.out / 'scores.md'}")


if __name__ == "__main__":
    main()
