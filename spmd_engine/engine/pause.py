"""pause_generation / resume_generation (vLLM's modes), for weight updates mid-rollout.

- "abort": every unfinished request finishes now with finish_reason "abort" and its
  tokens so far; pause_generation returns those outputs (partial rollouts). Steps in
  flight run first (their tokens drop), so nothing names those requests afterwards.
- "wait": the engine steps until every unfinished request has finished; returns
  the outputs those steps made.
- "keep": the steps in flight (PP's batch queue, async scheduling's step scheduled
  ahead) complete, then nothing more is
  scheduled: running requests keep their tokens and KV and continue after
  resume_generation(); returns the outputs of the completed steps.

While paused, add_request and abort_request still queue (applied at the next sync),
step() is a RuntimeError, and so is a second pause_generation. resume_generation()
when not paused does nothing (as vLLM). `clear_cache=True` resets the prefix cache
once paused; with "keep" it also drops the kept requests' KV
(reset_prefix_cache(reset_running_requests=True)): they recompute it on resume.
Under external_launcher every rank of the replica calls these together.
"""

from __future__ import annotations

MODES = ("abort", "wait", "keep")


class PauseState:
    def __init__(self):
        self.mode: str | None = None

    @property
    def paused(self) -> bool:
        return self.mode is not None


def pause(engine, mode: str = "abort", clear_cache: bool = False) -> list:
    """Pause `engine` (an LLMEngine); the RequestOutputs the pause produced."""
    if mode not in MODES:
        raise ValueError(f"pause_generation mode must be one of {MODES}, got mode={mode!r}")
    if not isinstance(clear_cache, bool):
        raise ValueError(f"clear_cache must be True or False, got {clear_cache!r}")
    if engine.pause.paused:
        raise RuntimeError(f"generation is already paused (mode={engine.pause.mode!r}): resume_generation() first")
    engine.sync()
    outputs = []
    if mode == "abort":
        outputs = [out for _, out in engine.abort_now(list(engine.outputs.states))]
        # Steps in flight or scheduled ahead (PP's batch queue, async scheduling) still name the
        # aborted requests: they run now, before a weight update or sleep, and their tokens drop.
        outputs += [out for _, out in engine.outputs.process(engine._client.drain())]
    elif mode == "wait":
        while engine.has_unfinished_requests():
            outputs += engine.step()
    else:
        outputs = [out for _, out in engine.outputs.process(engine._client.drain())]
    engine.pause.mode = mode
    if clear_cache:
        engine._client.call_core("reset_prefix_cache", mode == "keep")
    return outputs


def resume(engine) -> None:
    engine.pause.mode = None
