"""One rank: its Worker (device, groups, RPC surface), its ModelRunner, KV sizing."""
