#!/usr/bin/env bash
# Carry a study in progress to another machine, or over a machine that loses its ignored folders between sessions:
#
#   scripts/state_archive.sh save state/lr_transfer.tar.xz mlruns reports/ablations/lr_transfer
#   scripts/state_archive.sh list state/lr_transfer.tar.xz
#   scripts/state_archive.sh restore state/lr_transfer.tar.xz      # then the study's own command resumes it
#
# `save` packs the named paths (relative to the repository root; checkpoints under runs/ are left out unless named)
# into one xz tarball. A sqlite database among them (Optuna's optuna.db, MLflow's mlflow.db) is copied through
# sqlite's online backup, so a study may keep running while it is saved and the copy is still consistent. Finished
# cells are what carries over: a cell that was running restarts from its first step, as after a kill without its
# checkpoint. `restore` unpacks in the repository root and refuses (exit 2, nothing written) when any path in the
# archive exists already, so it never mixes two stores. MLflow keeps absolute artifact paths: restore into a
# checkout at the same path. Exit codes: 0 done, 2 bad input.
set -euo pipefail

ROOT="${STATE_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"  # STATE_ROOT: another root (the tests)
PYTHON="${PYTHON:-python3}"
MANIFEST=.state-archive-paths  # inside the archive: the paths it was asked to save, one a line

usage() {
  echo "usage: scripts/state_archive.sh save ARCHIVE PATH... | list ARCHIVE | restore ARCHIVE" >&2
  exit 2
}

save() {
  local archive=$1; shift
  [ $# -ge 1 ] || usage
  case "$archive" in *.tar.xz) ;; *) echo "error: the archive '$archive' must end in .tar.xz" >&2; exit 2 ;; esac
  local p
  for p in "$@"; do
    case "$p" in /*|*..*) echo "error: '$p' must be a path inside the repository, relative to its root" >&2; exit 2 ;; esac
    [ -e "$ROOT/$p" ] || { echo "error: '$p' does not exist under $ROOT; nothing was written" >&2; exit 2; }
  done
  STAGE=$(mktemp -d)
  trap 'rm -rf "$STAGE"' EXIT
  local stage=$STAGE status=0
  # tar says 1 when a file changed while it was read: a running study's log or artifact, taken as it was
  (cd "$ROOT" && tar --exclude='*.db' --exclude='*.db-journal' --exclude='*.db-wal' --exclude='*.db-shm' \
    --warning=no-file-changed -cf "$stage.tar" "$@") || status=$?
  [ "$status" -le 1 ] || { echo "error: tar could not read $*" >&2; exit 1; }
  tar -xf "$stage.tar" -C "$stage" && rm -f "$stage.tar"
  # the databases, through sqlite's online backup (consistent while a study writes to them)
  (cd "$ROOT" && find "$@" -name '*.db' -type f) | while read -r db; do
    mkdir -p "$stage/$(dirname "$db")"
    "$PYTHON" -c 'import sqlite3, sys
src, dst = sqlite3.connect(sys.argv[1]), sqlite3.connect(sys.argv[2])
src.backup(dst); dst.close(); src.close()' "$ROOT/$db" "$stage/$db"
  done
  printf '%s\n' "$@" > "$stage/$MANIFEST"
  mkdir -p "$(dirname "$archive")"
  tar -C "$stage" -cJf "$archive.tmp" "$MANIFEST" "$@"
  mv "$archive.tmp" "$archive"
  echo "saved $(du -h "$archive" | cut -f1) to $archive: $*"
}

restore() {
  local archive=$1
  [ -f "$archive" ] || { echo "error: no archive at '$archive'" >&2; exit 2; }
  local clash
  clash=$(tar -xOJf "$archive" "$MANIFEST" | while read -r p; do [ -e "$ROOT/$p" ] && echo "$p"; done || true)
  if [ -n "$clash" ]; then
    echo "error: $archive holds paths that exist already ($(echo "$clash" | tr '\n' ' ')); restoring would mix" \
      "two stores. Move them away first; nothing was written" >&2
    exit 2
  fi
  tar -C "$ROOT" -xJf "$archive" --exclude="$MANIFEST"
  echo "restored $archive into $ROOT"
}

# the archive's path is taken from the current folder, the saved paths from the repository root
[ $# -ge 2 ] && case "$2" in /*) ;; *) set -- "$1" "$PWD/$2" "${@:3}" ;; esac

case "${1:-}" in
  save) shift; [ $# -ge 2 ] || usage; save "$@" ;;
  list) [ $# -eq 2 ] || usage; tar -tJvf "$2" ;;
  restore) [ $# -eq 2 ] || usage; restore "$2" ;;
  *) usage ;;
esac
