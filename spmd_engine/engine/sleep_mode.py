"""sleep / wake_up (vLLM's levels, modes and tags): colocated training takes the memory.

Level 0 pauses scheduling only (requests are still accepted, nothing runs); level 1
also frees the KV cache (on CUDA the weights move to host memory); level 2 also
discards the weights, which must be loaded again before the next generate. Every
level first pauses the engine in `mode` (engine/pause.py: "abort" finishes the
unfinished requests, "wait" runs them to the end, "keep" holds them), and levels 1
and 2 forget the prefix cache. wake_up(tags) brings back "weights" and "kv_cache"
(None: both); scheduling resumes once both are back ("scheduling" names it for a
level-0 sleep), and the engine serves again only then.
"""

from __future__ import annotations

import logging

from spmd_engine.config import ConfigError

logger = logging.getLogger("spmd_engine")

TAGS = ("weights", "kv_cache", "scheduling")


class SleepMode:
    def __init__(self, enabled: bool):
        self.enabled = bool(enabled)
        self.asleep: set[str] = set()  # the tags given back, until wake_up
        self.weights_discarded = False  # sleep(2) ran: generate checks the workers loaded weights since

    def sleep(self, engine, level: int = 1, mode: str = "abort") -> list[dict]:
        """Returns each worker's report (rss_before, rss_after, freed_bytes; device_freed_bytes
        on CUDA); none at level 0."""
        if not self.enabled:
            raise ConfigError("sleep needs LLM(..., enable_sleep_mode=True)")
        if isinstance(level, bool) or level not in (0, 1, 2):
            raise ValueError(f"sleep level must be 0, 1 or 2, got level={level!r}")
        from spmd_engine.engine.pause import MODES
        if mode not in MODES:
            raise ValueError(f"sleep mode must be one of {MODES}, got mode={mode!r}")
        if self.asleep:  # vLLM's executor warns and does nothing: clients sleep again without a check
            logger.warning("sleep(level=%s): the engine is already asleep (%s given back); nothing done",
                           level, ", ".join(sorted(self.asleep)))
            return []
        paused_here = not engine.pause.paused
        if paused_here:  # what the pause finished (aborted requests) comes back from the next step()
            engine.keep_for_next_step(engine.pause_generation(mode, clear_cache=level >= 1))
        if level == 0:
            self.asleep.add("scheduling")
            return []
        try:
            reports = [r for replica in engine._client.call_core("sleep", level) for r in replica]
        except BaseException:
            if paused_here:  # refused (requests still hold KV blocks): the engine runs on as before
                engine.resume_generation()
            raise
        self.asleep.add("scheduling")
        self.asleep |= {"weights", "kv_cache"}
        self.weights_discarded = self.weights_discarded or level == 2
        return reports

    def wake_up(self, engine, tags: list[str] | None = None) -> bool:
        """Scheduling resumes once the memory is all back, as in vLLM (TRL wakes "weights", loads,
        then wakes "kv_cache" and generates); "scheduling" alone ends a level-0 sleep. Returns
        True when the engine is fully awake (vLLM's return value)."""
        if tags is None:
            tags = list(TAGS)
        if isinstance(tags, str) or not all(t in TAGS for t in tags):
            raise ValueError(f"wake_up tags must be a list of {', '.join(map(repr, TAGS))}, got tags={tags!r}")
        memory = [t for t in tags if t in ("weights", "kv_cache") and t in self.asleep]
        if memory:
            engine._client.call_core("wake_up", memory)
        self.asleep -= set(memory)
        if not self.asleep & {"weights", "kv_cache"}:
            self.asleep.discard("scheduling")
            if engine.pause.paused:
                engine.resume_generation()
        return not self.asleep

    def check_awake(self) -> None:
        if self.asleep:
            raise RuntimeError(f"the engine is asleep ({', '.join(sorted(self.asleep))} given back by "
                               f"sleep()): call wake_up() before generate")

    def check_weights_loaded(self, collective_rpc) -> None:
        """Refuse to run the model on weights sleep(2) discarded and that were not all loaded
        again (a half-done push would serve a mix of two policies)."""
        if not self.weights_discarded:
            return
        missing = sorted({name for names in collective_rpc("unwritten_weights") for name in names})
        if missing and not any(collective_rpc("weights_loaded_since_discard")):
            raise RuntimeError("sleep(level=2) discarded the weights: load_weights(...) or "
                               "collective_rpc('reload_weights') before generate")
        if missing:
            raise RuntimeError(f"sleep(level=2) discarded the weights and {len(missing)} tensors have not "
                               f"been loaded since (first: {missing[0]}): load_weights(...) every tensor, "
                               f"or collective_rpc('reload_weights'), before generate")
        self.weights_discarded = False
