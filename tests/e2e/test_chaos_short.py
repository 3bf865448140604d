"""The short chaos run of CI (issue 25): one seeded trial of scripts/chaos.py, a torchrun job
(TP 2, --max-restarts 3) with its drawn faults, must survive with the unfaulted run's bytes
and leave nothing behind. The long soak is `scripts/chaos.py --trials 50`."""

from __future__ import annotations

import subprocess
import sys

import pytest
from launch import REPO, base_env


@pytest.mark.timeout(420)
def test_one_seeded_chaos_trial_survives_identical_and_clean(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/chaos.py", "--trials", "1", "--seed", "1", "--first", "1",
                           "--launcher", "torchrun", "--workdir", str(tmp_path)], cwd=REPO,
                          env=base_env("chaos-ci"), capture_output=True, text=True, timeout=400)
    assert "trials 1, survived 1, identical 1, leaks 0" in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == 0
