#!/usr/bin/env bash
# Extract a diffusers source distribution and apply this directory's patch series to it, so that
# `pip install DEST_DIR` builds the patched diffusers.
#
#   patches/apply-to-sdist.sh diffusers-0.42.1.tar.gz /tmp/diffusers-patched
#   pip install /tmp/diffusers-patched
#
# DEST_DIR must not exist or be empty. It becomes a git repository: one commit with the sdist as
# released, then one commit per applied patch (`git am`). A patch whose files live in a folder the
# sdist doesn't ship (the sdist has no docs/) is skipped with a message; any other patch that does
# not apply stops the script with a non-zero exit status.
set -euo pipefail

die() {
    echo "apply-to-sdist.sh: error: $*" >&2
    exit 1
}

[ $# -eq 2 ] || die "usage: $0 SDIST_TARBALL DEST_DIR"
sdist=$1
dest=$2
patch_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

[ -f "$sdist" ] || die "no such file: $sdist"
command -v git >/dev/null || die "git is needed"
if [ -e "$dest" ] && [ -n "$(ls -A "$dest")" ]; then
    die "$dest exists and is not empty"
fi

shopt -s nullglob
patches=("$patch_dir"/[0-9][0-9][0-9][0-9]-*.patch)
shopt -u nullglob
[ ${#patches[@]} -gt 0 ] || die "no NNNN-*.patch files in $patch_dir"

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
    # Top-level folders the patch touches, e.g. "src" or "docs".
    missing=""
    for top in $(sed -n 's#^diff --git a/\([^/]*\)/.* b/.*#\1#p' "$patch" | sort -u); do
        [ -d "$dest/$top" ] || missing="$missing $top/"
    done
    if [ -n "$missing" ]; then
        echo "skipped $name: the sdist has no$missing"
        continue
    fi
    if ! git_ am -q --whitespace=error-all "$patch"; then
        git_ am --abort >/dev/null 2>&1 || true
        die "$name does not apply to $(basename "$sdist")"
    fi
    echo "applied $name"
    applied=$((applied + 1))
done

[ $applied -gt 0 ] || die "no patch was applied"
echo "patched diffusers in $dest: pip install $dest"
