"""What a saved package checks before every call, and where it is kept (compilation/precompiled.py).

A package is native code built for fixed dtypes, ranks, sizes and contiguity; called with
anything else it reads memory wrongly rather than failing. So `Package.accepts` is the only
thing between a step and a wrong answer, and each refusal here is one kind of input that must
run eager instead. The spec is a real one's form: weights, caches, then the step's tensors.
Where a package is kept: inductor's cache folder, built there once by whichever process gets the
build lock first.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from spmd_engine.compilation import precompiled


class _Loader:  # what Package reads of torch's loader: the metadata written at build time
    def __init__(self, spec):
        self.spec = spec

    def get_metadata(self):
        return {precompiled._SPEC_KEY: json.dumps(self.spec)}


def _inputs(n=3, blocks=5):
    weight = torch.randn(8, 4, dtype=torch.bfloat16)
    norm = torch.ones(4, dtype=torch.bfloat16)
    cache = torch.zeros(blocks, 2, 1, 4, dtype=torch.bfloat16)
    hidden = torch.randn(n, 4, dtype=torch.bfloat16)
    slots = torch.arange(n)
    return [weight, norm, cache, hidden, slots]


def _package(**kw):
    example = _inputs(**kw)
    dims = [None, None, {0: "NB"}, {0: "N"}, {0: "N"}]
    any_layout = [True, False, False, False, False]
    spec = [precompiled._entry(t, d, a) for t, d, a in zip(example, dims, any_layout)]
    return precompiled.Package("p.pt2", _Loader(spec))


def test_the_inputs_it_was_built_for_and_other_dynamic_sizes_are_accepted():
    package = _package()
    assert package.accepts(_inputs())
    assert package.accepts(_inputs(n=17, blocks=40))


def test_a_packed_weight_may_stand_where_a_dense_one_was_exported():
    flat = _inputs()
    flat[0] = flat[0].to_mkldnn()
    assert _package().accepts(flat)


@pytest.mark.parametrize("change", [
    "dtype", "rank", "fixed size", "not contiguous", "too few tokens", "tokens disagree", "device kind",
    "dense weight not contiguous is fine", "count",
])
def test_each_kind_of_misfit_is_refused(change):
    flat = _inputs()
    if change == "dtype":
        flat[1] = flat[1].float()
    elif change == "rank":
        flat[3] = flat[3].unsqueeze(0)
    elif change == "fixed size":
        flat[2] = torch.zeros(5, 2, 1, 8, dtype=torch.bfloat16)
    elif change == "not contiguous":
        flat[3] = torch.zeros(3, 8, dtype=torch.bfloat16)[:, ::2]
    elif change == "too few tokens":
        flat[3], flat[4] = flat[3][:1], flat[4][:1]
    elif change == "tokens disagree":
        flat[4] = torch.arange(4)
    elif change == "device kind":
        flat[1] = flat[1].to("meta")
    elif change == "dense weight not contiguous is fine":  # the packed weight's place: eager code reads it
        flat[0] = torch.randn(4, 8, dtype=torch.bfloat16).t()
        assert _package().accepts(flat)
        return
    elif change == "count":
        flat = flat[:-1]
    assert not _package().accepts(flat)


def test_weights_seen_before_are_not_checked_again_but_a_new_object_is():
    package = _package()
    flat = _inputs()
    assert package.accepts(flat)
    package.remember(flat, leading=3)
    assert package.accepts(flat[:3] + _inputs(n=9)[3:])  # the same weights and caches, another step
    other = list(flat)
    other[1] = flat[1].float()  # a weight update that replaced a Parameter with another dtype
    assert not package.accepts(other)


def test_the_cache_directory_is_inductors_own_without_importing_it(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "x")  # so that teardown undoes what inductor sets
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # inductor makes the folder: not in /tmp
    assert str(precompiled.cache_dir()) == cache_dir()  # inductor's call sets the variable: ours first
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "rel" / ".." / "ind"))
    assert str(precompiled.cache_dir()) == cache_dir()


_HOLDER = r"""
import sys, time
from pathlib import Path
from spmd_engine.compilation import precompiled
with precompiled.build_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


@pytest.mark.timeout(120)
def test_a_package_being_built_elsewhere_is_waited_for_and_a_dead_builder_releases_it(tmp_path):
    path = tmp_path / "cache" / "key.pt2"
    with precompiled.build_lock(path) as waited:
        assert not waited
    for seconds, kill in ((2.0, False), (300.0, True)):
        holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path), str(seconds)], stdout=subprocess.PIPE,
                                  text=True)
        try:
            assert holder.stdout.readline().strip() == "held"
            if kill:  # a builder that dies mid-build must not leave every later start waiting
                holder.kill()
                holder.wait()
            start = time.monotonic()
            with precompiled.build_lock(path) as waited:
                assert waited is not kill
                assert (time.monotonic() - start > 1.0) is not kill
        finally:
            holder.kill()
            holder.wait()
            holder.stdout.close()


def test_a_size_named_by_a_weight_or_cache_seen_before_still_binds_the_step_inputs():
    """Skipping the cache's check must not skip what its block count says of the step's tensors
    (here a last input that must have as many rows as the cache has blocks)."""
    example = _inputs()
    example[4] = torch.zeros(5, dtype=torch.long)
    spec = [precompiled._entry(t, d, False) for t, d in zip(example, [None, None, {0: "NB"}, {0: "N"}, {0: "NB"}])]
    package = precompiled.Package("p.pt2", _Loader(spec))
    assert package.accepts(example)
    package.remember(example, leading=3)
    for _ in range(2):  # the first call after remember() and every one after it
        assert package.accepts(example[:4] + [torch.zeros(5, dtype=torch.long)])
        assert not package.accepts(example[:4] + [torch.zeros(6, dtype=torch.long)])
        package.remember(example, leading=3)


def test_packages_are_for_cpu_graphs_only():
    """On CUDA the layers go through dynamo at every start: on an H200 (torch 2.11) loading a
    CUDA package crashed the process (docs/running.md)."""
    import torch.compiler.config
    if torch.compiler.config.force_disable_caches:
        pytest.skip("inductor's caches are forced off here")
    assert precompiled.applies("inductor", "cpu") and precompiled.applies("inductor", torch.device("cpu"))
    assert not precompiled.applies("inductor", "cuda") and not precompiled.applies("inductor", torch.device("cuda", 0))
    assert not precompiled.applies("eager", "cpu")

