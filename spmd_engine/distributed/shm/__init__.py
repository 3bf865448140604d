"""Shared memory between the processes of one host: one layer, three protocols on it.

Bottom up:

- segment.py: a /dev/shm segment, space reserved up front, with an explicit `Lifetime`
  for its name (what a SIGKILL at any moment can leave behind).
- futex.py, ring.py: a ring of chunks in one segment (one writer, N readers, sequence
  numbers), readers sleeping on a futex the writer wakes.
- waiter.py: the one wait loop (poll, yield, sleep) every end uses, with its checks.
- peers.py: the set-up hand-shake (one host, everyone switched on) and peer liveness.
- broken.py: broken for good after any failure.

On top, one file per protocol, each with its own switch (spmd_engine/envs.py):

- message_queue.py: the mp executor's broadcast queue (engine -> workers -> engine).
- allreduce.py: all-reduce and all-gather slots of a TP group
  (SPMD_ENGINE_DISABLE_SHM_ALLREDUCE).
- handoff.py: the PP hand-off between stages (SPMD_ENGINE_DISABLE_SHM_HANDOFF).

Nothing here imports the executor. This __init__ imports nothing (nor does
spmd_engine.distributed's, until a name of it is used), so importing the queue alone, as
the mp executor does, loads no torch.
"""
