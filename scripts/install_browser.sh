#!/usr/bin/env bash
# Install the browser the browser tests drive (tests/test_browser.py): Debian's Chromium,
# /usr/bin/chromium. Playwright drives it through `executable_path`, so nothing is
# downloaded by Playwright itself.
#
# Idempotent: does nothing when /usr/bin/chromium exists. Otherwise installs Debian's
# `chromium` package when run as root (as CI does, through `make test`); as any other
# user it prints how to install it and exits non-zero (the browser tests then skip).
set -euo pipefail

CHROMIUM=/usr/bin/chromium
[ -x "$CHROMIUM" ] && exit 0

if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install_browser.sh: no $CHROMIUM; install Debian's chromium as root (sudo $0, or sudo apt-get install chromium) to run the browser tests" >&2
    exit 1
fi

echo "install_browser.sh: installing Debian's chromium (for tests/test_browser.py)"
export DEBIAN_FRONTEND=noninteractive
# Wait for another apt/dpkg run (up to 10 minutes) instead of failing on its lock.
APT=(apt-get -q -o DPkg::Lock::Timeout=600)
for step in "update" "install -y --no-install-recommends chromium"; do
    # Quiet unless it fails; then show apt's own words.
    if ! log=$("${APT[@]}" $step 2>&1); then
        printf '%s\n' "$log" | tail -n 20 >&2
        echo "install_browser.sh: apt-get $step failed" >&2
        exit 1
    fi
done
test -x "$CHROMIUM"
echo "install_browser.sh: $("$CHROMIUM" --version 2>/dev/null || echo "$CHROMIUM installed")"
