"""Runs diffusers' own `test_model_cpu_offload_forward_pass` over its pipeline tests, once with stock offload and once
with each of this package's options forced on (`tools/force_offload_options.py`), on the CPU, and reports the tests
that pass with stock and fail with an option. Needs a checkout of diffusers' `tests/` (not shipped with the sdist)
and the stand-in tokenizers of `fake_hf_cache.py`:

    python tools/diffusers_own_tests.py --diffusers-tree PATH --hf-home DIR [--options stock,exclude,...] [--json]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
OPTIONS = ("stock", "exclude", "keep_during", "keep_between", "budget")
TEST = "test_model_cpu_offload_forward_pass"


def run(tree: str, hf_home: str, option: str, timeout: int) -> dict:
    """`{test id: (outcome, first line of the message)}` of one pytest run."""
    with tempfile.TemporaryDirectory() as scratch:
        report = os.path.join(scratch, "report.xml")
        env = dict(os.environ, HF_HOME=hf_home, HF_HUB_OFFLINE="1", FORCE_OFFLOAD_OPTION=option)
        env["PYTHONPATH"] = os.pathsep.join([HERE, env.get("PYTHONPATH", "")])
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "force_offload_options", "-q"]
        command += ["--rootdir=.", "--continue-on-collection-errors", "-k", TEST, f"--junitxml={report}"]
        subprocess.run(command + ["tests/pipelines"], cwd=tree, env=env, timeout=timeout, capture_output=True)
        return outcomes(report)


def outcomes(report: str) -> dict:
    found = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        key = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = (child.get("message") or "").strip().splitlines()[0][:160] if child.get("message") else ""
        found[key] = (outcome, message)
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--diffusers-tree", required=True, help="a diffusers checkout (its tests/ is used)")
    parser.add_argument("--hf-home", required=True, help="an HF_HOME made by fake_hf_cache.py")
    parser.add_argument("--options", default=",".join(OPTIONS), help=f"comma-separated, of {', '.join(OPTIONS)}")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per run, 60 to 7200 (default 1800)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    chosen = [o.strip() for o in args.options.split(",") if o.strip()]
    bad = [o for o in chosen if o not in OPTIONS]
    if bad or not chosen or not 60 <= args.timeout <= 7200:
        parser.error(f"`--options` must name some of {list(OPTIONS)} (got {args.options!r}); `--timeout` 60 to 7200.")
    if not os.path.isdir(os.path.join(args.diffusers_tree, "tests", "pipelines")):
        parser.error(f"`--diffusers-tree` {args.diffusers_tree!r} has no tests/pipelines: pass a diffusers checkout.")
    runs = dict.fromkeys(["stock", *chosen])  # stock once, even when `--options` names it
    results = {option: run(args.diffusers_tree, args.hf_home, option, args.timeout) for option in runs}
    stock_passed = sorted(t for t, (o, _) in results["stock"].items() if o == "passed")
    summary = {"stock_passed": len(stock_passed), "options": {}}
    for option in chosen:
        if option == "stock":
            continue
        broken = {t: results[option].get(t, ("missing", "")) for t in stock_passed}
        broken = {t: r for t, r in broken.items() if r[0] != "passed"}
        summary["options"][option] = {"passed": len(stock_passed) - len(broken), "broken": broken}
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    counts = {
        o: sum(1 for r in results["stock"].values() if r[0] == o) for o in ("passed", "failed", "error", "skipped")
    }
    print(f"stock: {counts}")
    for option, entry in summary["options"].items():
        print(f"{option:<13} {entry['passed']} of the {len(stock_passed)} tests that pass with stock pass")
        for test, (outcome, message) in entry["broken"].items():
            print(f"    {outcome}: {test}: {message}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
