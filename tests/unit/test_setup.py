"""bin/setup against a busy apt: it waits and says so, instead of failing at once."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SETUP = Path(__file__).parents[2] / "bin" / "setup"


def test_setup_waits_for_the_apt_lock(tmp_path: Path) -> None:
    # A stand-in apt-get that finds the lock held twice, then succeeds.
    tries = tmp_path / "tries"
    fake = tmp_path / "apt-get"
    fake.write_text(
        "#!/bin/sh\n"
        f'echo x >> "{tries}"\n'
        f'[ "$(wc -l < "{tries}")" -gt 2 ] && exit 0\n'
        'echo "E: Could not get lock /var/lib/apt/lists/lock. It is held by process 1" >&2\n'
        "exit 100\n"
    )
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "APT_LOCK_POLL": "0"}
    result = subprocess.run(
        ["sh", str(SETUP), "--apt-update-only"], capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "waiting for it" in result.stdout
    assert len(tries.read_text().splitlines()) == 3


def test_setup_gives_up_on_other_apt_errors(tmp_path: Path) -> None:
    fake = tmp_path / "apt-get"
    fake.write_text('#!/bin/sh\necho "E: Some index files failed to download" >&2\nexit 100\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "APT_LOCK_POLL": "0"}
    result = subprocess.run(
        ["sh", str(SETUP), "--apt-update-only"], capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode != 0
    assert "failed to download" in result.stderr
