"""`--gpu-memory` sizes: both unit families at their word, a bare number as bytes, the rest refused."""

import pytest

from spmd_engine.config import ConfigError
from spmd_engine.plan.sizes import parse_size


@pytest.mark.parametrize("text, size", [
    ("80GiB", 80 * 2**30), ("80gib", 80 * 2**30), ("80 GiB", 80 * 2**30), ("80GB", 80 * 10**9),
    ("80e9", 80 * 10**9), ("85899345920", 85899345920), ("1.5TiB", 3 * 2**39), ("512MiB", 2**29),
    ("141GB", 141 * 10**9), ("123456789012345678", 123456789012345678),
])
def test_sizes_people_write(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["80G", "eighty", "80 GiB of it", "", "-1GiB", "0", "GiB", "1e-3"])
def test_anything_else_is_a_config_error_naming_the_flag(text):
    with pytest.raises(ConfigError, match=r"^--gpu-memory '.*' (is not a size|must be at least one byte)"):
        parse_size(text)
