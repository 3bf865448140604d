"""Weight transfer between a trainer job and a running engine (vLLM 0.34's protocol):
config.py (what both sides agree on), packing.py (the wire form), group.py (the transfer
group and its store), receiver.py (an engine rank), trainer.py (the sending trainer).
docs/weight-transfer.md says when to use it and how."""
