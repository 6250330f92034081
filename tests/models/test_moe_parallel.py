"""Expert parallelism at the model level on 8 CPU devices (a subprocess): every dispatcher and
capacity mode gives the loss, router statistics and gradients of pure data parallelism when
the data-parallel size is the same (8), and layouts with the same data-parallel size agree with
each other (Megatron's aux losses and capacity are per data-parallel rank). The train-loop
version (EP 2/4 losses equal EP 1) is in tests/parallel/test_layouts.py."""
import json
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

DP8 = ["ep2", "ep4", "ep8"]
DP4 = ["ep2_tp2", "ep2_cp2"]      # compared with tp2
# Capacity is per device's tokens, as in Megatron (per rank, after the CP split): a context-
# parallel split changes which tokens compete for a slot, so those runs differ on purpose.
CAPACITY = ("capacity", "padded", "padded_alltoall", "position")


def _worker(pairs):
    out = subprocess.run([sys.executable, str(ROOT / "tests/models/moe_parallel_worker.py"),
                          *pairs], capture_output=True, text=True, cwd=ROOT, timeout=3000,
                         env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin",
                              "PYTHONPATH": f"{ROOT}:{ROOT / 'tests/models'}",
                              "XLA_FLAGS": "--xla_backend_optimization_level=0"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def _close(a, b, name):
    np.testing.assert_allclose(a["value"], b["value"], rtol=2e-6, err_msg=name)
    np.testing.assert_allclose(a["stats"], b["stats"], rtol=1e-5, atol=1e-6, err_msg=name)
    g, h = np.asarray(a["grads"]), np.asarray(b["grads"])
    assert np.max(np.abs(g - h)) <= 1e-4 * np.max(np.abs(h)), name


@pytest.mark.parametrize("variant", ["dropless", "alltoall", "capacity", "padded",
                                     "padded_alltoall", "position"])
def test_expert_parallel_matches_data_parallel(variant):
    dp4 = [m for m in DP4 if not (variant in CAPACITY and m.endswith("cp2"))]
    got = _worker([f"{variant}:{m}" for m in ["dp8", *DP8, "tp2", *dp4]])
    for m in DP8:
        _close(got[f"{variant}:{m}"], got[f"{variant}:dp8"], f"{variant}:{m}")
    for m in dp4:
        _close(got[f"{variant}:{m}"], got[f"{variant}:tp2"], f"{variant}:{m}")


def test_expert_tensor_parallel_1_replicates_experts_over_tensor():
    got = _worker(["etp1:tp2", "etp1:ep2_tp2", "dropless:tp2"])
    _close(got["etp1:ep2_tp2"], got["etp1:tp2"], "etp1")
    _close(got["etp1:tp2"], got["dropless:tp2"], "etp1 vs etp=tp")


@pytest.mark.parametrize("variant", ["fp8", "fp8_alltoall", "fp8_padded"])
def test_fp8_expert_gemms_match_data_parallel(variant):
    """Quantized expert GEMMs (delayed scaling) under EP: the amaxes are of the whole tensor,
    so losses, gradients and the new amax histories and scales (compared with the gradients)
    are those of pure data parallelism."""
    got = _worker([f"{variant}:{m}" for m in ["dp8", "ep2", "ep4"]])
    for m in ("ep2", "ep4"):
        _close(got[f"{variant}:{m}"], got[f"{variant}:dp8"], f"{variant}:{m}")


def test_latent_experts_match_data_parallel():
    """Megatron's latent MoE (moe_latent_size): the routed experts work in the projected width
    under expert and tensor parallelism with data parallelism's results."""
    got = _worker([f"latent:{m}" for m in ["dp8", "ep2", "ep4", "tp2", "ep2_tp2"]])
    for m in ("ep2", "ep4"):
        _close(got[f"latent:{m}"], got["latent:dp8"], f"latent:{m}")
    _close(got["latent:ep2_tp2"], got["latent:tp2"], "latent:ep2_tp2")


def test_attention_output_dim_layer_matches_data_parallel():
    """MaxText's qwen3_custom_moe layer (attention to a narrower width, the MoE layer there,
    projected up) under expert and tensor parallelism: data parallelism's results."""
    got = _worker([f"serial:{m}" for m in ["dp8", "ep2", "ep4", "tp2", "ep2_tp2"]])
    for m in ("ep2", "ep4"):
        _close(got[f"serial:{m}"], got["serial:dp8"], f"serial:{m}")
    _close(got["serial:ep2_tp2"], got["serial:tp2"], "serial:ep2_tp2")


@pytest.mark.slow
def test_deepseek_v4_matches_data_parallel():
    """DeepSeek-V4 (compressed attention with the indexer, hash-routed layers, hyper-connection
    streams and their head) under expert and tensor parallelism: data parallelism's results."""
    got = _worker([f"v4:{m}" for m in ["dp8", "ep2", "ep4", "tp2", "ep2_tp2"]])
    for m in ("ep2", "ep4"):
        _close(got[f"v4:{m}"], got["v4:dp8"], f"v4:{m}")
    _close(got["v4:ep2_tp2"], got["v4:tp2"], "v4:ep2_tp2")


@pytest.mark.parametrize("variant", ["k3", "k3_qb"])
def test_kimi_k3_matches_data_parallel(variant):
    """Kimi K3 (KDA and gated MLA layers, attention residuals, SiTU, the stable latent MoE;
    k3_qb: with its quantile rule's margin histograms, pooled over the ranks) under expert,
    tensor and context parallelism: data parallelism's results."""
    got = _worker([f"{variant}:{m}" for m in ["dp8", "ep2", "ep4", "ep2_cp2", "tp2", "ep2_tp2"]])
    for m in ("ep2", "ep4"):
        _close(got[f"{variant}:{m}"], got[f"{variant}:dp8"], f"{variant}:{m}")
    for m in ("ep2_tp2", "ep2_cp2"):   # the same ranks' tokens as tp2 (4 data-parallel ranks)
        _close(got[f"{variant}:{m}"], got[f"{variant}:tp2"], f"{variant}:{m}")


def test_quantile_balancing_matches_data_parallel():
    """Megatron's quantile balancing: each data-parallel rank's quantile over its tokens
    (gathered from the context and tensor shards), averaged over the ranks: expert
    parallelism gives data parallelism's, and context/tensor splits of the same ranks' tokens
    the same as tensor parallelism's."""
    got = _worker([f"qb:{m}" for m in ["dp8", "ep2", "ep4", "tp2", "ep2_tp2", "ep2_cp2"]])
    for m in ("ep2", "ep4"):
        _close(got[f"qb:{m}"], got["qb:dp8"], f"qb:{m}")
    for m in ("ep2_tp2", "ep2_cp2"):
        _close(got[f"qb:{m}"], got["qb:tp2"], f"qb:{m}")
