# Build the tree before the refactor at $1 from this working tree: the changed files restored, the added ones removed.
set -e
dst=$1; src=$(pwd)
rm -rf "$dst"; mkdir -p "$dst"
cp -r adaflash_hf examples pyproject.toml "$dst"/
cp -r .evaldata/before/files/. "$dst"/
while read f; do rm -f "$dst/$f"; done < .evaldata/before/added.txt
