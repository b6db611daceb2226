#!/usr/bin/env python3
"""Check the upstream patch series of this folder the way a diffusers maintainer would, without network.

`make check-patches` runs it with `.venv-patch-tools` (diffusers' pinned `ruff` and `hf-doc-builder`) and the
PyPI source distributions in `build/sdist`. For each series folder (`v0.42.1/`, `main/`):

1. Every patch whose files the matching sdist has (or that only adds files) must apply with plain
   `git am --whitespace=error-all` (no `-C`, no `-3`) onto that sdist as released. The sdists ship `src/` and, of
   `tests/`, only `tests/testing_utils.py`. `main/` is checked against the 0.40.0 sdist: its
   `src/diffusers/pipelines/pipeline_utils.py` is the fetched `main`'s byte for byte.
2. The other patches (the pipeline tester mixins, the docs) are applied to a fixture made of their own pre-image
   hunks (so: well-formed, no whitespace errors, the docs' new code blocks styled); they must be identical in both
   series. With `--diffusers-repo` they are also applied to real trees (see below).
3. `ruff check`, `ruff format --check` (the sdist's `pyproject.toml`) on the changed Python files;
   `doc-builder style --max_len 119 --check_only` on the changed files under `src/` (what `make quality` runs) and
   on the new Markdown, as `.mdx`, which `doc-builder` would otherwise skip.
4. The feature patch changes fewer than 80 lines of `pipeline_utils.py`; the test patches don't patch
   `torch.nn.Module.to`; the docs' examples use no private attribute; `PR.md` links diffusers#11872 and
   accelerate#3695 and ticks no box without a link.

`--diffusers-repo DIR` (a clone or the bare mirror of huggingface/diffusers that has commit 58eb52c, 2026-08-23)
adds the full check: both series applied with plain `git am` to `main` and to `main` with the 0.42.1 sdist's files
laid over it, `ruff` on every changed file, `doc-builder style` on `src/diffusers` and `docs/source`, and diffusers'
own `utils/check_*.py` scripts that don't need to import diffusers, each compared with the unpatched tree.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SERIES = {"v0.42.1": "0.42.1", "main": "0.40.0"}
MAIN_COMMIT = "58eb52c0803ea9af3abec60841c2a093bdf1f951"
FEATURE_SUBJECT = "Add `exclude_from_offload` and `keep_on_device_during_generation`"
FEATURE_FILE = "src/diffusers/pipelines/pipeline_utils.py"
MAX_FEATURE_LINES = 80
# diffusers' `utils/check_*.py` that read the sources without importing diffusers
TEXT_CHECKS = ["check_copies.py", "check_dummies.py", "check_doc_toc.py", "check_support_list.py"]
SDIST_FILES = ["src", "setup.py", "pyproject.toml", "README.md", "LICENSE", "MANIFEST.in", "tests/testing_utils.py"]

BIN = Path(sys.executable).parent
failures = []


def report(ok, what):
    print(f"  {'ok  ' if ok else 'FAIL'} {what}")
    if not ok:
        failures.append(what)
    return ok


def run(cmd, cwd=None, env=None):
    # the tools' directory first on PATH: diffusers' `utils/check_copies.py` runs `ruff` itself
    env = {**(env or os.environ), "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)


def git(tree, *args):
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "check",
        "GIT_AUTHOR_EMAIL": "check@localhost",
        "GIT_COMMITTER_NAME": "check",
        "GIT_COMMITTER_EMAIL": "check@localhost",
    }
    return run(["git", "-c", "core.autocrlf=false", "-c", "commit.gpgsign=false", *args], cwd=tree, env=env)


class Patch:
    def __init__(self, path):
        self.path = Path(path)
        self.text = self.path.read_text()
        self.subject = re.search(r"^Subject: \[PATCH[^\]]*\] (.*(?:\n .*)*)", self.text, re.M).group(1)
        self.subject = " ".join(self.subject.split())
        self.changed = re.findall(r"^--- a/(\S+)$", self.text, re.M)  # existing files it changes
        self.files = re.findall(r"^\+\+\+ b/(\S+)$", self.text, re.M)
        self.hunks = {}  # file -> [(old start, pre-image lines, post-image lines)]
        current = None
        for line in self.text.split("\n"):
            if line.startswith("diff --git"):
                current = None
            elif line.startswith("+++ b/"):
                current = self.hunks.setdefault(line[6:], [])
            elif line.startswith("@@") and current is not None:
                start = int(re.match(r"@@ -(\d+)", line).group(1))
                current.append((start, [], []))
            elif current and line[:1] in (" ", "-", "+") and not line.startswith(("---", "+++")):
                _, old, new = current[-1]
                if line[0] in " -":
                    old.append(line[1:])
                if line[0] in " +":
                    new.append(line[1:])

    def added_lines(self, file):
        block = re.search(rf"^\+\+\+ b/{re.escape(file)}\n(.*?)(?=^diff --git|\Z)", self.text, re.M | re.S).group(1)
        return [line[1:] for line in block.split("\n") if line.startswith("+")]

    def body(self):
        """The patch without the lines that differ between two `git format-patch` runs of the same change."""
        return "\n".join(line for line in self.text.split("\n")[1:] if not line.startswith(("Date:", "index ", "@@")))


def numstat(patch, file):
    """Added and removed lines of `file` as git counts them."""
    result = run(["git", "apply", "--numstat", str(patch.path)])
    for line in result.stdout.splitlines():
        added, removed, name = line.split("\t")
        if name == file:
            return int(added), int(removed)
    return 0, 0


def new_tree(path):
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    git(path, "init", "-q")
    return path


def commit_all(tree, message):
    git(tree, "add", "-A", "-f", ".")
    return git(tree, "commit", "-q", "--allow-empty", "-m", message)


def extract_sdist(sdist, dest):
    new_tree(dest)
    with tarfile.open(sdist) as tar:
        top = tar.getmembers()[0].name.split("/")[0]
        tar.extractall(dest.parent / "_extract", filter="data")
    for item in (dest.parent / "_extract" / top).iterdir():
        shutil.move(str(item), dest / item.name)
    shutil.rmtree(dest.parent / "_extract")
    commit_all(dest, f"{sdist.name} as released")
    return dest


def git_am(tree, patch):
    result = git(tree, "am", "-q", "--whitespace=error-all", str(patch.path))
    if result.returncode != 0:
        git(tree, "am", "--abort")
    return result


def ruff(tree, files):
    py = [f for f in files if f.endswith(".py") and (tree / f).exists()]
    if not py:
        return True, ""
    check = run([str(BIN / "ruff"), "check", *py], cwd=tree)
    fmt = run([str(BIN / "ruff"), "format", "--check", *py], cwd=tree)
    return check.returncode == 0 and fmt.returncode == 0, check.stdout + fmt.stdout


def doc_builder(paths, cwd):
    result = run([str(BIN / "doc-builder"), "style", *paths, "--max_len", "119", "--check_only"], cwd=cwd)
    return result.returncode == 0, result.stdout + result.stderr


def markdown_as_mdx(tree, files):
    """`doc-builder style` skips `.md` files: check changed Markdown files as `.mdx` copies."""
    md = [f for f in files if f.endswith(".md") and (tree / f).exists()]
    if not md:
        return True, ""
    with tempfile.TemporaryDirectory() as tmp:
        for f in md:
            shutil.copy(tree / f, Path(tmp) / (f.replace("/", "__")[:-3] + ".mdx"))
        return doc_builder([tmp], cwd=tmp)


def fixture_for(patches, dest):
    """A tree with the pre-image of every file `patches` change, made from their own hunks (other lines blank)."""
    new_tree(dest)
    done = set()
    for patch in patches:
        for file in patch.changed:
            if file in done:
                continue
            done.add(file)
            lines = []
            for start, old, _ in patch.hunks[file]:
                lines += [""] * (start - 1 - len(lines))
                lines[start - 1 : start - 1 + len(old)] = old
            (dest / file).parent.mkdir(parents=True, exist_ok=True)
            (dest / file).write_text("\n".join(lines) + "\n")
    commit_all(dest, "pre-image fixture")
    return dest


def check_series(name, sdist_dir, work):
    folder = HERE / name
    patches = [Patch(p) for p in sorted(folder.glob("[0-9][0-9][0-9][0-9]-*.patch"))]
    version = SERIES[name]
    sdist = sdist_dir / f"diffusers-{version}.tar.gz"
    print(f"\n{name}/ ({len(patches)} patches) against the PyPI sdist diffusers {version}")
    if not report(bool(patches), f"{name}: has patches"):
        return patches
    tree = extract_sdist(sdist, work / name)
    applied, deferred = [], []
    for patch in patches:
        if all((tree / f).is_file() for f in patch.changed):
            result = git_am(tree, patch)
            report(
                result.returncode == 0,
                f"{name}: `git am` {patch.path.name}" + (f"\n{result.stderr}" if result.returncode else ""),
            )
            if result.returncode == 0:
                applied.append(patch)
        else:
            deferred.append(patch)
    files = sorted({f for patch in applied for f in patch.files})
    ok, out = ruff(tree, files)
    report(
        ok,
        f"{name}: ruff check + format --check on {len([f for f in files if f.endswith('.py')])} changed files"
        + (f"\n{out}" if not ok else ""),
    )
    src = [f for f in files if f.startswith("src/")]
    ok, out = doc_builder(src, cwd=tree) if src else (True, "")
    report(ok, f"{name}: doc-builder style --check_only on {src}" + (f"\n{out}" if not ok else ""))

    if deferred:
        fixture = fixture_for(deferred, work / f"{name}-fixture")
        for patch in deferred:
            result = git_am(fixture, patch)
            report(
                result.returncode == 0,
                f"{name}: `git am` {patch.path.name} onto the fixture of its own pre-image (the sdist lacks {', '.join(f for f in patch.changed if not (tree / f).is_file())})"
                + (f"\n{result.stderr}" if result.returncode else ""),
            )
        md = sorted({f for patch in deferred for f in patch.files if f.endswith(".md")})
        ok, out = markdown_as_mdx(fixture, md)
        report(
            ok,
            f"{name}: doc-builder style --check_only on the new Markdown of {md} (as .mdx)"
            + (f"\n{out}" if not ok else ""),
        )

    feature = [p for p in patches if p.subject.startswith(FEATURE_SUBJECT)]
    if report(len(feature) == 1, f"{name}: one feature patch ({FEATURE_SUBJECT}...)"):
        added, removed = numstat(feature[0], FEATURE_FILE)
        report(
            added + removed < MAX_FEATURE_LINES,
            f"{name}: the feature changes {added + removed} lines of {FEATURE_FILE} (+{added} -{removed}), fewer than {MAX_FEATURE_LINES}",
        )
    for patch in patches:
        for file in patch.files:
            if file.startswith("tests/"):
                patched_to = [
                    line
                    for line in patch.added_lines(file)
                    if re.search(
                        r"(torch\.)?nn\.Module\.to\s*=|patch\.object\(\s*(torch\.)?nn\.Module\s*,\s*[\"']to[\"']", line
                    )
                ]
                report(
                    not patched_to,
                    f"{name}: {patch.path.name} {file} doesn't patch torch.nn.Module.to"
                    + (f": {patched_to}" if patched_to else ""),
                )
            if file.endswith(".md"):
                code, private = False, []
                for line in patch.added_lines(file):
                    if line.startswith("```"):
                        code = not code
                    elif code and re.search(r"\.\s*_[a-z]\w*", line):
                        private.append(line.strip())
                report(
                    not private,
                    f"{name}: the examples of {file} use public API only" + (f": {private}" if private else ""),
                )
    return patches


def check_pr_text():
    print("\nPR.md")
    text = (HERE / "PR.md").read_text()
    report("github.com/huggingface/diffusers/issues/11872" in text, "PR.md links diffusers#11872")
    report("github.com/huggingface/accelerate/pull/3695" in text, "PR.md links accelerate#3695")
    report("link the issue here" not in text.lower(), "PR.md has no placeholder link")
    # a ticked box with its continuation lines
    ticked = re.findall(r"^[ \t]*[-*] \[[xX]\].*(?:\n[ \t]+\S.*)*", text, re.M)
    report(all("https://" in item for item in ticked), f"PR.md ticks no box without a link ({len(ticked)} ticked)")


def full_check(repo, sdist_dir, work):
    """Both series against real trees made from a diffusers repository."""
    print(f"\nfull check against {repo} ({MAIN_COMMIT[:10]})")
    bases = {}
    git_dir = Path(repo) if (Path(repo) / "HEAD").is_file() else Path(repo) / ".git"
    main = new_tree(work / "upstream-main")
    archive = subprocess.run(f"git --git-dir='{git_dir}' archive {MAIN_COMMIT} | tar -x -C '{main}'", shell=True)
    if not report(archive.returncode == 0, f"{MAIN_COMMIT[:10]} read from {git_dir}"):
        return
    commit_all(main, "main")
    bases["main"] = main
    v0421 = work / "upstream-v0.42.1"
    if v0421.exists():
        shutil.rmtree(v0421)
    shutil.copytree(main, v0421, symlinks=True)
    sdist = extract_sdist(sdist_dir / "diffusers-0.42.1.tar.gz", work / "_sdist-0.42.1")
    for item in SDIST_FILES:
        target = v0421 / item
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
        (shutil.copytree if (sdist / item).is_dir() else shutil.copy)(sdist / item, target)
    commit_all(v0421, "main with the 0.42.1 sdist's files")
    bases["v0.42.1"] = v0421
    stock_status = {}
    for name, tree in bases.items():
        stock_status[name] = {c: run([sys.executable, f"utils/{c}"], cwd=tree).returncode for c in TEXT_CHECKS}
    for name, tree in bases.items():
        patches = [Patch(p) for p in sorted((HERE / name).glob("[0-9][0-9][0-9][0-9]-*.patch"))]
        for patch in patches:
            result = git_am(tree, patch)
            report(
                result.returncode == 0,
                f"{name}: `git am` {patch.path.name} onto the {name} tree"
                + (f"\n{result.stderr}" if result.returncode else ""),
            )
        files = sorted({f for patch in patches for f in patch.files})
        ok, out = ruff(tree, files)
        report(ok, f"{name} tree: ruff check + format --check on {files}" + (f"\n{out}" if not ok else ""))
        ok, out = doc_builder(["src/diffusers", "docs/source"], cwd=tree)
        report(
            ok,
            f"{name} tree: doc-builder style src/diffusers docs/source --max_len 119 --check_only"
            + (f"\n{out}" if not ok else ""),
        )
        ok, _ = markdown_as_mdx(tree, files)
        # not a failure: the page's existing examples aren't styled either, the new ones are checked above
        print(
            f"  info changed Markdown of the {name} tree as .mdx: {'styled' if ok else 'not styled (stock examples)'}"
        )
        for check in TEXT_CHECKS:
            rc = run([sys.executable, f"utils/{check}"], cwd=tree).returncode
            report(
                rc == stock_status[name][check],
                f"{name} tree: utils/{check} exits {rc}, unpatched {stock_status[name][check]}",
            )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sdist-dir", type=Path, default=Path("build/sdist"))
    parser.add_argument("--work", type=Path, default=Path("build/check-patches"))
    parser.add_argument("--series", nargs="*", default=list(SERIES), help="series folders to check")
    parser.add_argument("--diffusers-repo", help="a clone or bare mirror of huggingface/diffusers for the full check")
    args = parser.parse_args()
    args.work = args.work.resolve()
    args.sdist_dir = args.sdist_dir.resolve()
    series = {name: check_series(name, args.sdist_dir, args.work) for name in args.series}
    if len(series) == 2:
        print("\nboth series")
        a, b = series.values()
        for pa, pb in zip(a, b):
            if not pa.files or not all(f.startswith(("tests/", "docs/")) for f in pa.files):
                continue
            report(pa.body() == pb.body(), f"{pa.path.name} is the same in both series")
    check_pr_text()
    if args.diffusers_repo:
        full_check(args.diffusers_repo, args.sdist_dir, args.work)
    print(f"\n{len(failures)} check(s) failed" if failures else "\nall checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
