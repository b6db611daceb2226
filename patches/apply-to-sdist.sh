#!/usr/bin/env bash
# Extract a diffusers source distribution and apply patch series of this directory to it, in order, so
# that `pip install DEST_DIR` builds the patched diffusers.
#
#   patches/apply-to-sdist.sh diffusers-0.42.1.tar.gz /tmp/diffusers-patched    # patches/fixes, patches/v0.42.1
#   patches/apply-to-sdist.sh diffusers-0.40.0.tar.gz /tmp/diffusers-main patches/fixes patches/main
#   pip install /tmp/diffusers-patched
#
# DEST_DIR must not exist or be empty. It becomes a git repository: one commit with the sdist as
# released, then one commit per applied patch (`git am`, no fuzz, no whitespace errors). The sdist
# ships `src/` and, of `tests/`, only `tests/testing_utils.py`: the files a patch changes that the sdist
# doesn't have (the pipeline tester mixins, a pipeline's own test file, the docs) are left out with a
# message, and a patch that changes only such files is skipped; the rest of each patch must apply, or
# the script stops with an error.
set -euo pipefail

die() {
    echo "apply-to-sdist.sh: error: $*" >&2
    exit 1
}

[ $# -ge 2 ] || die "usage: $0 SDIST_TARBALL DEST_DIR [SERIES_DIR...]"
sdist=$1
dest=$2
shift 2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[ $# -gt 0 ] || set -- "$here/fixes" "$here/v0.42.1"

[ -f "$sdist" ] || die "no such file: $sdist"
command -v git >/dev/null || die "git is needed"
if [ -e "$dest" ] && [ -n "$(ls -A "$dest")" ]; then
    die "$dest exists and is not empty"
fi

patches=()
for series in "$@"; do
    [ -d "$series" ] || die "no such series folder: $series"
    series=$(cd "$series" && pwd)
    shopt -s nullglob
    found=("$series"/[0-9][0-9][0-9][0-9]-*.patch)
    shopt -u nullglob
    [ ${#found[@]} -gt 0 ] || die "no NNNN-*.patch files in $series"
    patches+=("${found[@]}")
done

mkdir -p "$dest"
# The sdist has a single top-level folder, diffusers-X.Y.Z/.
tar -xzf "$sdist" -C "$dest" --strip-components=1 || die "could not extract $sdist"
[ -f "$dest/src/diffusers/pipelines/pipeline_utils.py" ] || die "$sdist does not look like a diffusers sdist"

# Commit with a fixed identity: the patches keep their own authors.
export GIT_AUTHOR_NAME="apply-to-sdist" GIT_AUTHOR_EMAIL="apply-to-sdist@localhost"
export GIT_COMMITTER_NAME="apply-to-sdist" GIT_COMMITTER_EMAIL="apply-to-sdist@localhost"
git_() { git -C "$dest" -c core.autocrlf=false -c commit.gpgsign=false "$@"; }

git_ init -q
git_ add -A -f .
git_ commit -q -m "$(basename "$sdist") as released"

applied=0
for patch in "${patches[@]}"; do
    name=$(basename "$patch")
    # Files the patch changes (new files have `--- /dev/null`).
    missing=""
    for file in $(sed -n 's#^--- a/##p' "$patch" | sort -u); do
        [ -f "$dest/$file" ] || missing="$missing $file"
    done
    label="$(basename "$(dirname "$patch")")/$name"
    excludes=()
    for file in $missing; do
        excludes+=("--exclude=$file")
    done
    present=$(sed -n 's#^+++ b/##p' "$patch" | sort -u | grep -v -x -F -f <(printf '%s\n' $missing) || true)
    if [ -z "$present" ]; then
        echo "skipped $label: the sdist has no$missing"
        continue
    fi
    if ! git_ am -q --whitespace=error-all "${excludes[@]}" "$patch"; then
        git_ am --abort >/dev/null 2>&1 || true
        die "$name does not apply to $(basename "$sdist")"
    fi
    if [ -n "$missing" ]; then
        echo "applied $label without$missing (not in the sdist)"
    else
        echo "applied $label"
    fi
    applied=$((applied + 1))
done

[ $applied -gt 0 ] || die "no patch was applied"
echo "patched diffusers in $dest: pip install $dest"
