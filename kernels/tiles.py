"""What the kernels' tuning tables share: the tile rules Triton imposes and the GPU vendor."""
from __future__ import annotations

import jax

# Triton's tl.dot needs every matmul dimension >= 16.
MIN_BLOCK = 16


def check_blocks(obj, fields: tuple[str, ...]) -> None:
    """Each named tile of ``obj`` is None or a power of two >= MIN_BLOCK (ValueError)."""
    for field in fields:
        size = getattr(obj, field)
        if size is not None and (size < MIN_BLOCK or size & (size - 1)):
            raise ValueError(f"{type(obj).__name__}.{field}={size}: need a power of two >= "
                             f"{MIN_BLOCK}")


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= max(n, MIN_BLOCK): a dimension padded to whole tiles."""
    return max(MIN_BLOCK, 1 << max(n - 1, 0).bit_length())


def default_vendor() -> str:
    """'cuda' or 'rocm' for the default GPU backend; 'cpu' when there is none."""
    if jax.default_backend() == "cpu":
        return "cpu"
    client = jax.devices()[0].client
    name = f"{client.platform} {client.platform_version}".lower()
    return "rocm" if "rocm" in name or "hip" in name else "cuda"
