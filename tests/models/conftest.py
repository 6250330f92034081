"""Model tests run in float32 (x64 off) at the highest matmul precision."""
import jax
import pytest


@pytest.fixture(autouse=True)
def _precise_fp32():
    x64 = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", False)
    with jax.default_matmul_precision("highest"):
        yield
    jax.config.update("jax_enable_x64", x64)
