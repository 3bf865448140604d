"""`--lora-modules` and a prompts-file line's adapter (spmd_engine/run/lora_modules.py), read
as vLLM's serve flag reads them: ids 1, 2, ... in order, `name=path` or a JSON object."""

from __future__ import annotations

import argparse

import pytest

from spmd_engine.config import ConfigError
from spmd_engine.run.lora_modules import line_adapter, served_adapters


def adapters(*entries, enable=True, base="bundled"):
    return served_adapters(argparse.Namespace(lora_modules=list(entries), enable_lora=enable), base)


def test_both_forms_get_ids_in_the_order_given():
    served = adapters("a=/x/a", '{"name": "b", "path": "/x/b", "base_model_name": "bundled"}', "c=/x/c=d")
    assert [(r.lora_name, r.lora_int_id, r.lora_path) for r in served.by_name.values()] == [
        ("a", 1, "/x/a"), ("b", 2, "/x/b"), ("c", 3, "/x/c=d")]
    assert served.by_name["b"].base_model_name == "bundled"
    assert served.resolve("b") is served.by_name["b"]
    assert served.resolve(None) is None and served.resolve("bundled") is None
    with pytest.raises(KeyError):
        served.resolve("z")


def test_no_flag_serves_nothing_and_needs_no_enable_lora():
    served = adapters(enable=False)
    assert not served and served.resolve(None) is None


@pytest.mark.parametrize("entries, enable, needle", [
    (["a=/x"], False, "--lora-modules needs --enable-lora"),
    (["a"], True, "'a' is neither name=path nor a JSON object"),
    (["a,b=/x"], True, "neither name=path nor a JSON object"),
    (['["a", "/x"]'], True, 'must be a JSON object {"name": ..., "path": ...}'),
    (['{"name": "a", "path": "/x", "rank": 8}'], True, "unknown fields rank"),
    (['{"name": "a"}'], True, "needs a non-empty path"),
    (["=/x"], True, "needs a non-empty name"),
    (["a="], True, "needs a non-empty path"),
    (["a=/x", "a=/y"], True, "the name 'a' is given twice"),
    (["bundled=/x"], True, "the name 'bundled' is the base model's name"),
    (['{"name": "a", "path": "/x", "is_3d_lora_weight": "no"}'], True, '"is_3d_lora_weight" must be true or false'),
])
def test_bad_entries_are_one_line_config_errors(entries, enable, needle):
    with pytest.raises(ConfigError) as err:
        adapters(*entries, enable=enable)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_line_names_its_adapter_by_lora_or_model():
    served = adapters("a=/x/a")
    assert line_adapter({"prompt": "p"}) is None
    assert line_adapter({"prompt": "p", "lora": None}) is None
    assert line_adapter({"prompt": "p", "lora": "a"}) == ("lora", "a")
    assert line_adapter({"prompt": "p", "model": "a", "lora": "a"}) == ("lora", "a")
    assert served.for_line(("lora", "a")).lora_name == "a"
    assert served.for_line(("model", "a")).lora_name == "a"
    assert served.for_line(("model", "bundled")) is None
    with pytest.raises(ConfigError, match="different models"):
        line_adapter({"prompt": "p", "model": "a", "lora": "b"})
    with pytest.raises(ConfigError, match=r'"lora" must be an adapter\'s name'):
        line_adapter({"prompt": "p", "lora": 3})
    with pytest.raises(ConfigError, match=r"\"model\": unknown LoRA adapter 'z' \(--lora-modules gives: a\)"):
        served.for_line(("model", "z"))


def test_without_the_flag_model_is_left_alone_but_lora_is_an_error():
    served = adapters()
    assert served.for_line(("model", "gpt-x")) is None  # as before --lora-modules existed
    with pytest.raises(ConfigError, match=r"unknown LoRA adapter 'a' \(no --lora-modules given\)"):
        served.for_line(("lora", "a"))
