#!/usr/bin/env bash
# Sourced by setup-lavapipe.sh and setup-shellcheck.sh: fetches Debian packages and unpacks them into a folder
# under .local, without root and without touching the system (apt-get download + dpkg -x). The package lists
# live in .local/apt and serve every caller (`update` only revalidates them).
#   apt_local_install DEST NAME PACKAGE...   unpacks PACKAGE... (apt's name[/release] forms) into DEST
apt_local_install() {
  local dest=$1 name=$2
  shift 2
  local root work
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  work="$root/.local/apt"
  mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/debs-$name"
  cat > "$work/sources.list" <<SRC
deb http://deb.debian.org/debian bookworm main
deb http://deb.debian.org/debian bookworm-updates main
deb http://deb.debian.org/debian bookworm-backports main
SRC
  local o=(-o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
    -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o APT::Sandbox::User=root)
  apt-get "${o[@]}" -qq update
  (cd "$work/debs-$name" && rm -f ./*.deb && apt-get "${o[@]}" -qq download "$@")
  rm -rf "$dest" && mkdir -p "$dest"
  local f
  for f in "$work/debs-$name"/*.deb; do dpkg -x "$f" "$dest"; done
}
