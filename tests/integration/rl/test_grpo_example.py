"""The colocated GRPO example (scripts/examples/rl_colocate.py) as a test: torchrun with 4
ranks, DDP trainer over the whole world, two TP=2 external_launcher rollout replicas, weights
pushed in place after every optimizer step. A short run must raise the reward, with the
trainer's recomputed logprobs matching the engine's; without the weight push (the negative
control) the engine keeps sampling from the old policy, so its logprobs drift from the trainer's
and the reward does not rise."""

import json
import re

import pytest
from conftest import require_reference
from launch import REPO, run_torchrun

SCRIPT = str(REPO / "scripts" / "examples" / "rl_colocate.py")
SHORT = ["--steps", "4", "--lr", "3e-3", "--prompts-per-replica", "2"]


def _run(extra: list[str]) -> tuple[list[float], list[float], list[str]]:
    """The reward, the largest |trainer - engine| logprob difference and the policy version the
    rollouts ran under, per step."""
    require_reference("transformers")  # the example's trainer model
    launch = run_torchrun(4, [SCRIPT, *SHORT, *extra], timeout=110)
    assert launch.returncode == 0, launch.describe()
    assert not launch.leftover_pids and not launch.stale_segments(), launch.describe()
    curve = json.loads(re.search(r"^REWARD_CURVE (.*)$", launch.stdout, re.M).group(1))
    diffs = [float(d) for d in re.findall(r"max \|trainer - engine logprob\| (\S+)", launch.stdout)]
    versions = re.findall(r"^step +\d+  policy (\S+)", launch.stdout, re.M)
    assert len(curve) == len(diffs) == len(versions) == 4, launch.describe()
    return curve, diffs, versions


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_grpo_reward_rises_when_the_weights_reach_the_engine():
    curve, diffs, versions = _run([])
    assert versions == ["None", "1", "2", "3"]  # each step's rollouts on the last pushed policy
    assert 0 < max(diffs) < 1e-3, diffs  # transformers' kernels are not the engine's  # trainer and engine run the same weights at every step
    assert curve[-1] == max(curve) and curve[-1] > curve[0] + 2.0, curve  # here: 1.50 -> 5.75


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_without_the_weight_push_the_engine_stays_on_the_old_policy():
    curve, diffs, versions = _run(["--no-weight-sync"])
    assert versions == ["None"] * 4
    assert diffs[0] < 1e-3 and min(diffs[1:]) > 1.0, diffs  # the trainer moved, the engine did not
    # Here 1.50, 1.56, 1.63, 1.50: draws from one policy (the 10-step control's spread over 0.34).
    assert max(curve) < curve[0] + 2.0, curve


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_batch_invariant_trainer_and_engine_logprobs_are_equal_bit_for_bit():
    """The engine in batch-invariant mode (TP=2 replicas) and the engine's own model as the
    trainer (one process, autograd): every sampled token's logprob equal, every step, after
    every weight push; the default mode's run above differs by ~1e-5."""
    curve, diffs, versions = _run(["--batch-invariant"])
    assert diffs == [0.0] * 4, diffs
    assert versions == ["None", "1", "2", "3"]
    assert curve[-1] > curve[0] + 1.0, curve  # here: 1.06 -> 3.94


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_lora_adapter_pushed_as_tensors_every_step_bit_for_bit():
    """`--lora 8 --batch-invariant`: the engine's own LoRA layers train a rank-8 adapter, pushed
    in place as tensors (add_lora(load_inplace=True)) after every step: the trainer's logprobs
    equal the engine's bit for bit at every step. Control: without the push the engine keeps
    the first adapter (B = 0) and the two differ from the second step on."""
    require_reference("peft")
    curve, diffs, versions = _run(["--batch-invariant", "--lora", "8"])
    assert diffs == [0.0] * 4, diffs
    assert versions == ["None", "1", "2", "3"]
    assert curve[-1] > curve[0] + 0.5, curve  # here: 1.06 -> 2.31
    _, stale, _ = _run(["--batch-invariant", "--lora", "8", "--no-weight-sync"])
    assert stale[0] == 0.0 and min(stale[1:]) > 1e-4, stale


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_lora_adapter_trained_by_peft_reaches_the_engine():
    """`--lora 8`: PEFT's adapter on transformers' model, pushed as verl pushes it (PEFT's own
    config dict, enums and all): the engine's logprobs follow the trainer's to float rounding."""
    require_reference("peft")
    curve, diffs, versions = _run(["--lora", "8"])
    assert versions == ["None", "1", "2", "3"]
    assert max(diffs) < 1e-3, diffs
    assert curve[-1] > curve[0] + 0.5, curve  # here: 1.06 -> 1.94
