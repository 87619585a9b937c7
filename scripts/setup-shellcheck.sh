#!/usr/bin/env bash
# Installs Debian bookworm's shellcheck into .local/shellcheck, without root and without touching the system
# (scripts/apt-local.sh, as setup-lavapipe.sh does for Mesa): the tests check every generated job
# script with it. Its libraries (libgmp, libffi) come along, so .local/shellcheck/run works on a machine
# without them. Idempotent: does nothing when .local/shellcheck is complete.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/.local/shellcheck"
stamp="$dest/.installed-v1"
[ -f "$stamp" ] && exit 0

# shellcheck source=scripts/apt-local.sh
source "$root/scripts/apt-local.sh"
echo "[setup-shellcheck] fetching shellcheck from Debian bookworm into .local/shellcheck"
apt_local_install "$dest" shellcheck shellcheck/bookworm libgmp10/bookworm libffi8/bookworm
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
