#!/usr/bin/env bash
# Installs Debian bookworm's shellcheck into .local/shellcheck, without root and without touching the system
# (apt-get download + dpkg -x, as setup-lavapipe.sh does for Mesa): the tests check every generated job
# script with it. Its libraries (libgmp, libffi) come along, so .local/shellcheck/run works on a machine
# without them. Idempotent: does nothing when .local/shellcheck is complete.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/.local/shellcheck"
stamp="$dest/.installed-v1"
[ -f "$stamp" ] && exit 0

# setup-lavapipe.sh's apt folder and sources: their package lists serve here too (a second download of
# bookworm's 18 MB list is avoided; `update` only revalidates them).
work="$root/.local/apt"
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/debs-shellcheck"
cat > "$work/sources.list" <<SRC
deb http://deb.debian.org/debian bookworm main
deb http://deb.debian.org/debian bookworm-updates main
deb http://deb.debian.org/debian bookworm-backports main
SRC
o=(-o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
   -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o APT::Sandbox::User=root)
echo "[setup-shellcheck] fetching shellcheck from Debian bookworm into .local/shellcheck"
apt-get "${o[@]}" -qq update
(cd "$work/debs-shellcheck" && rm -f ./*.deb && apt-get "${o[@]}" -qq download shellcheck/bookworm libgmp10/bookworm libffi8/bookworm)
rm -rf "$dest" && mkdir -p "$dest"
for f in "$work/debs-shellcheck"/*.deb; do dpkg -x "$f" "$dest"; done
# The entry point: the binary with its own libraries first on the search path.
cat > "$dest/run" <<'RUN'
#!/usr/bin/env bash
here=$(cd "$(dirname "$0")" && pwd)
LD_LIBRARY_PATH="$here/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/usr/bin/shellcheck" "$@"
RUN
chmod +x "$dest/run"
"$dest/run" --version >/dev/null
touch "$stamp"
echo "[setup-shellcheck] done"
