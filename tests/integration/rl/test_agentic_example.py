"""scripts/examples/agentic_rollout.py in a short form: torchrun with 4 ranks (two TP=2 replicas,
admission="rank0"), multi-turn episodes arriving mid-run, one weight update half-way with
pause(keep) / versioned load / reset of running requests / resume."""

import json

import pytest
from launch import REPO, run_torchrun

SCRIPT = str(REPO / "scripts" / "examples" / "agentic_rollout.py")
BLOCK = 16  # the engine's default block size


@pytest.mark.timeout(150)
def test_agentic_rollout_example(tmp_path):
    out = tmp_path / "rollouts.jsonl"
    launch = run_torchrun(4, [SCRIPT, "--out", out, "--episodes", "3", "--turns", "3", "--max-tokens", "8"],
                          timeout=140)
    assert launch.returncode == 0, launch.describe()
    assert not launch.leftover_pids and not launch.stale_segments(), launch.describe()
    episodes = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(e["episode"] for e in episodes) == [f"r{r}e{e}" for r in (0, 1) for e in range(3)]
    assert not list(tmp_path.glob("rollouts.jsonl.replica*"))  # merged and removed
    versions, cached = set(), []
    for ep in episodes:
        turns = ep["turns"]
        assert [t["turn"] for t in turns] == [0, 1, 2], ep
        order = [0 if t["weight_version"] is None else t["weight_version"] for t in turns]
        assert order == sorted(order), ep  # an episode never goes back to the old policy
        versions |= {t["weight_version"] for t in turns}
        for before, after in zip(turns, turns[1:]):
            # The follow-up's prompt is the whole transcript: it grows, and what the prefix cache
            # holds of it is whole blocks of the previous turn's prompt and completion.
            assert after["prompt_tokens"] > before["prompt_tokens"]
            assert after["num_cached_tokens"] % BLOCK == 0
            assert after["num_cached_tokens"] <= after["prompt_tokens"]
            cached.append(after["num_cached_tokens"])
        assert ep["transcript"].count("[tool]") == 3, ep
    assert versions == {None, 1}  # some turns before the update, some after
    assert max(cached) > 0  # follow-ups hit the prefix cache
