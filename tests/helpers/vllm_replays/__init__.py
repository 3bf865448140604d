"""The replays of tests/helpers/dist_scripts/vllm_clients.py, one module per client of vLLM
(the rank script's docstring says what each calls, from which source file), and `common`, the
pieces every replay uses. Not named `vllm_clients`: the tests import the rank script under that
name, and a package of the same name would shadow it (or be shadowed) on the path."""
