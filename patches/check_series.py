#!/usr/bin/env python3
"""Check the upstream patch series of this folder the way a diffusers maintainer would, without network.

`make check-patches` runs it with `.venv-patch-tools` (diffusers' pinned `ruff` and `hf-doc-builder`) and the
PyPI source distributions in `build/sdist`. Three series: `fixes/` (three bug fixes, for `main` and v0.42.1 alike),
then the feature, `main/` (for upstream) or its backport `v0.42.1/`. For each base (`main` and `v0.42.1`):

1. `fixes/` then the base's feature series apply with plain `git am --whitespace=error-all` (no `-C`, no `-3`) onto
   the sdist as released, each patch without the files the sdist lacks (`git am --exclude`). The sdists ship `src/`
   and, of `tests/`, only `tests/testing_utils.py`. `main` is checked against the 0.40.0 sdist: its
   `src/diffusers/pipelines/pipeline_utils.py` is the fetched `main`'s byte for byte.
2. The files the sdist lacks (the pipeline tester mixins, AudioLDM2's test file, the docs) are applied to a fixture
   made of their own pre-image hunks (so: well-formed, no whitespace errors, the docs' new code blocks styled); the
   tester mixins' and docs' changes must be the same in both feature series. With `--diffusers-repo` they are also
   applied to real trees (see below).
3. `ruff check`, `ruff format --check` (the sdist's `pyproject.toml`) on the changed Python files;
   `doc-builder style --max_len 119 --check_only` on the changed files under `src/` (what `make quality` runs) and
   on the new Markdown, as `.mdx`, which `doc-builder` would otherwise skip.
4. The feature patch changes fewer than 80 lines of `pipeline_utils.py`; the fixes don't mention the feature; no
   patch changes a deprecated pipeline; the test patches patch nothing (`mock.patch`, `monkeypatch`, assignments to
   `.to`) and build no device string from `torch_device` (`f"{torch_device}:0"`: `torch_device` can have an index);
   the docs' examples use no private attribute; the backport is marked as one in every commit message and the `main`
   series in none; `PR.md` links `ISSUE.md` and `PR-fixes.md`; `PR.md` and `ISSUE.md` link diffusers#11872,
   #14304, #14358, #6804 and accelerate#3695, and `ISSUE.md` compares with Modular Diffusers' auto offload; both
   PR texts follow diffusers' pull request template (its headings) and say "Breaking changes: none"; no text ticks a
   box without a link.

`--diffusers-repo DIR` (a clone or the bare mirror of huggingface/diffusers that has commit 58eb52c, 2026-08-23, the
newest `main` fetched) adds the full check: the series applied with plain `git am` to `main` and to `main` with the
0.42.1 sdist's files laid over it, `ruff` on every changed file, `doc-builder style` on `src/diffusers` and
`docs/source`, and diffusers' own `utils/check_*.py` scripts that don't need to import diffusers, each compared with
the unpatched tree.
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
FIXES = "fixes"
#: base -> (its feature series, the PyPI sdist it is checked against)
BASES = {"main": ("main", "0.40.0"), "v0.42.1": ("v0.42.1", "0.42.1")}
BACKPORT_MARK = "Backport to diffusers v0.42.1"
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

    def message(self):
        """The commit message (subject and body)."""
        return self.text.split("\n---\n", 1)[0]

    def diff(self):
        """The change without the lines that differ between two bases (blob hashes, line numbers)."""
        text = self.text[self.text.index("\ndiff --git") : self.text.rindex("\n-- \n")]
        return "\n".join(line for line in text.split("\n") if not line.startswith(("index ", "@@")))


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


def git_am(tree, patch, exclude=(), include=()):
    paths = [f"--exclude={f}" for f in exclude] + [f"--include={f}" for f in include]
    result = git(tree, "am", "-q", "--whitespace=error-all", *paths, str(patch.path))
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
    """A tree with the pre-image of the files `patches` change (`[(patch, files)]`), made from their own hunks (other
    lines blank)."""
    new_tree(dest)
    done = set()
    for patch, files in patches:
        for file in files:
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


def load(folder):
    return [Patch(p) for p in sorted((HERE / folder).glob("[0-9][0-9][0-9][0-9]-*.patch"))]


def check_base(base, sdist_dir, work):
    """`fixes/` then the base's feature series onto the base's sdist, and the checks of one series."""
    feature_folder, version = BASES[base]
    fixes, feature = load(FIXES), load(feature_folder)
    print(f"\n{FIXES}/ ({len(fixes)} patches) then {feature_folder}/ ({len(feature)}) onto the PyPI sdist {version}")
    if not report(bool(fixes) and bool(feature), f"{base}: both series have patches"):
        return feature
    tree = extract_sdist(sdist_dir / f"diffusers-{version}.tar.gz", work / base)
    applied, deferred = [], []  # [(patch, the files of it applied there)]
    for patch in fixes + feature:
        label = f"{patch.path.parent.name}/{patch.path.name}"
        missing = [f for f in patch.changed if not (tree / f).is_file()]
        present = [f for f in patch.files if f not in missing]
        if present:
            result = git_am(tree, patch, exclude=missing)
            without = f" without {', '.join(missing)} (not in the sdist)" if missing else ""
            report(
                result.returncode == 0,
                f"{base}: `git am` {label}{without}" + (f"\n{result.stderr}" if result.returncode else ""),
            )
            if result.returncode == 0:
                applied.append((patch, present))
        if missing:
            deferred.append((patch, missing))
    files = sorted({f for _, present in applied for f in present})
    ok, out = ruff(tree, files)
    count = len([f for f in files if f.endswith(".py")])
    report(ok, f"{base}: ruff check + format --check on {count} changed files" + (f"\n{out}" if not ok else ""))
    src = [f for f in files if f.startswith("src/")]
    ok, out = doc_builder(src, cwd=tree) if src else (True, "")
    report(ok, f"{base}: doc-builder style --check_only on {src}" + (f"\n{out}" if not ok else ""))
    deprecated = [
        f
        for f in src
        if "/deprecated/" in f or re.search(r"^class \w+\([^)]*DeprecatedPipelineMixin", (tree / f).read_text(), re.M)
    ]
    report(not deprecated, f"{base}: no deprecated pipeline changed" + (f": {deprecated}" if deprecated else ""))

    if deferred:
        fixture = fixture_for(deferred, work / f"{base}-fixture")
        for patch, missing in deferred:
            result = git_am(fixture, patch, include=missing)
            report(
                result.returncode == 0,
                f"{base}: `git am` {patch.path.name} onto the fixture of its own pre-image of {', '.join(missing)} "
                "(not in the sdist)" + (f"\n{result.stderr}" if result.returncode else ""),
            )
        md = sorted({f for _, missing in deferred for f in missing if f.endswith(".md")})
        ok, out = markdown_as_mdx(fixture, md)
        report(
            ok,
            f"{base}: doc-builder style --check_only on the new Markdown of {md} (as .mdx)"
            + (f"\n{out}" if not ok else ""),
        )

    check_contents(base, fixes, feature)
    return feature


def check_contents(base, fixes, feature):
    """What the patches may and may not contain."""
    found = [p for p in feature if p.subject.startswith(FEATURE_SUBJECT)]
    if report(len(found) == 1, f"{base}: one feature patch ({FEATURE_SUBJECT}...)"):
        added, removed = numstat(found[0], FEATURE_FILE)
        report(
            added + removed < MAX_FEATURE_LINES,
            f"{base}: the feature changes {added + removed} lines of {FEATURE_FILE} (+{added} -{removed}), fewer than {MAX_FEATURE_LINES}",
        )
    leaked = [p.path.name for p in fixes if "exclude_from_offload" in p.text or "keep_on_device" in p.text]
    report(not leaked, f"{base}: the fixes don't depend on the feature" + (f": {leaked}" if leaked else ""))
    marked = [BACKPORT_MARK in p.message() for p in feature]
    report(
        all(marked) if base == "v0.42.1" else not any(marked),
        f"{base}: the backport marked as such in {'every' if base == 'v0.42.1' else 'no'} commit message",
    )
    for patch in fixes + feature:
        for file in patch.files:
            if file.startswith("tests/"):
                patched = [
                    line.strip()
                    for line in patch.added_lines(file)
                    if re.search(r"mock\.patch|monkeypatch\.|patch\.object\(|\.to\s*=[^=]|setattr\(", line)
                ]
                report(
                    not patched,
                    f"{base}: {patch.path.name} {file} patches nothing" + (f": {patched}" if patched else ""),
                )
                indexed = [line.strip() for line in patch.added_lines(file) if "{torch_device}:" in line]
                report(
                    not indexed,
                    f"{base}: {patch.path.name} {file} builds no device string from `torch_device`"
                    + (f": {indexed}" if indexed else ""),
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
                    f"{base}: the examples of {file} use public API only" + (f": {private}" if private else ""),
                )


LINKS = {
    "diffusers#11872": "github.com/huggingface/diffusers/issues/11872",
    "diffusers#14304": "github.com/huggingface/diffusers/pull/14304",
    "diffusers#14358": "github.com/huggingface/diffusers/pull/14358",
    "diffusers#6804": "github.com/huggingface/diffusers/issues/6804",
    "accelerate#3695": "github.com/huggingface/accelerate/pull/3695",
}
# the headings of diffusers' .github/PULL_REQUEST_TEMPLATE.md
TEMPLATE_HEADINGS = ["# What does this PR do?", "## Before submitting", "## Who can review?"]


def check_texts():
    print("\nPR.md, PR-fixes.md, ISSUE.md")
    texts = {name: (HERE / name).read_text() for name in ("PR.md", "PR-fixes.md", "ISSUE.md")}
    for name in ("PR.md", "ISSUE.md"):
        for label, link in LINKS.items():
            report(link in texts[name], f"{name} links {label}")
    for name in ("PR.md", "PR-fixes.md"):
        pasted = texts[name].split("\n---\n", 1)[-1]
        missing = [h for h in TEMPLATE_HEADINGS if not re.search(rf"^{re.escape(h)}$", pasted, re.M)]
        report(not missing, f"{name} has the headings of diffusers' PR template" + (f": {missing}" if missing else ""))
        report("Breaking changes: none" in pasted, f'{name} says "Breaking changes: none"')
    report("ISSUE.md" in texts["PR.md"], "PR.md links the design issue (ISSUE.md)")
    report("PR-fixes.md" in texts["PR.md"], "PR.md says the fixes come first (PR-fixes.md)")
    report("enable_auto_cpu_offload" in texts["ISSUE.md"], "ISSUE.md compares with Modular Diffusers' auto offload")
    for name, text in texts.items():
        report("link the issue here" not in text.lower(), f"{name} has no placeholder link")
        # a ticked box with its continuation lines
        ticked = re.findall(r"^[ \t]*[-*] \[[xX]\].*(?:\n[ \t]+\S.*)*", text, re.M)
        report(
            all("https://" in item for item in ticked), f"{name} ticks no box without a link ({len(ticked)} ticked)"
        )


def full_check(repo, sdist_dir, work):
    """The series against real trees made from a diffusers repository."""
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
        patches = load(FIXES) + load(BASES[name][0])
        for patch in patches:
            result = git_am(tree, patch)
            report(
                result.returncode == 0,
                f"{name}: `git am` {patch.path.parent.name}/{patch.path.name} onto the {name} tree"
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
    parser.add_argument("--bases", nargs="*", default=list(BASES), help="bases to check: main, v0.42.1")
    parser.add_argument("--diffusers-repo", help="a clone or bare mirror of huggingface/diffusers for the full check")
    args = parser.parse_args()
    args.work = args.work.resolve()
    args.sdist_dir = args.sdist_dir.resolve()
    features = {base: check_base(base, args.sdist_dir, args.work) for base in args.bases}
    if len(features) == 2:
        print("\nboth feature series")
        a, b = features.values()
        report([p.subject for p in a] == [p.subject for p in b], "the same commits in main/ and v0.42.1/")
        for pa, pb in zip(a, b):
            if all(f.startswith(("tests/", "docs/")) for f in pa.files):
                report(pa.diff() == pb.diff(), f"{pa.path.name}: the same change in both")
    check_texts()
    if args.diffusers_repo:
        full_check(args.diffusers_repo, args.sdist_dir, args.work)
    print(f"\n{len(failures)} check(s) failed" if failures else "\nall checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
