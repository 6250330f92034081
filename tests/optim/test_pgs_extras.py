"""pgs's optimisation extras (train.adagc, train.adamc, train.llrd_decay, train.hyperball,
train.mona) against NumPy re-implementations of pgs's formulas, side by side with pgs's own
torch classes where its checkout can be imported, and built from configs end to end.

The reference implementations work on the parameters as pgs's torch model holds them: one
named tensor per layer (``model.layers.{i}...``), which :func:`torch_view` cuts out of
jaxtrain's stacked leaves.
"""
import importlib.util
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxtrain.config import ConfigError, load_config
from jaxtrain.optim import pgs_extras
from jaxtrain.optim.optimizers import OptimConfig, build_optimizer, leaf_plan
from jaxtrain.optim.schedules import ScheduleConfig, make_lr_schedule, warmup_steps_of

D, L, F, V = 4, 3, 6, 8
AXES = {
    "embedding": P("vocab", "embed"),
    "output": P("embed", "vocab"),
    "final_norm": {"scale": P("norm")},
    "layers": {
        "attn_norm": {"scale": P("norm", "layers")},
        "mlp": {"wi": P("embed", "layers", "mlp"), "wo": P("mlp", "layers", "embed"),
                "bo": P("embed", "layers")},
    },
}
SHAPES = {
    "embedding": (V, D), "output": (D, V), "final_norm": {"scale": (D,)},
    "layers": {"attn_norm": {"scale": (D, L)},
               "mlp": {"wi": (D, L, F), "wo": (F, L, D), "bo": (D, L)}},
}
PLAN = leaf_plan(AXES)
IS_SHAPE = lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x)  # noqa: E731

# pgs's torch names of the tensors; per layer: (torch name, leaf path)
TOP = {"model.embed_tokens.weight": ("embedding",), "lm_head.weight": ("output",),
       "model.norm.weight": ("final_norm", "scale")}
PER_LAYER = {"input_layernorm.weight": ("attn_norm", "scale"), "mlp.up_proj.weight": ("mlp", "wi"),
             "mlp.down_proj.weight": ("mlp", "wo"), "mlp.down_proj.bias": ("mlp", "bo")}
CONSTRAINED = ("mlp.up_proj.weight", "mlp.down_proj.weight")  # pgs's Hyperball matrices


def tree(seed, scale=1.0):
    shapes, treedef = jax.tree.flatten(SHAPES, is_leaf=IS_SHAPE)
    rng = np.random.default_rng(seed)
    return treedef.unflatten([jnp.asarray(scale * rng.standard_normal(s), jnp.float32)
                              for s in shapes])


def get(t, path):
    for k in path:
        t = t[k]
    return t


def torch_view(t) -> dict[str, np.ndarray]:
    """name -> float64 tensor, one per layer for the stacked leaves (layer axis 1)."""
    out = {name: np.asarray(get(t, path), np.float64) for name, path in TOP.items()}
    for i in range(L):
        for name, path in PER_LAYER.items():
            out[f"model.layers.{i}.{name}"] = np.take(
                np.asarray(get(t["layers"], path), np.float64), i, axis=1)
    return out


def run_steps(opt, params, grads_list):
    """Apply ``opt`` to each gradient tree: (list of update trees, list of params after each)."""
    state = opt.init(params)
    updates, history = [], []
    for g in grads_list:
        u, state = opt.update(g, state, params)
        params = optax.apply_updates(params, u)
        updates.append(u)
        history.append(params)
    return updates, history


def close(a: dict, b: dict, **tol):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], err_msg=k, **tol)


def cfg(**kw):
    kw.setdefault("clip_grad", 0.0)
    return OptimConfig(**kw)


def sgd_cfg(**kw):  # plain SGD: the optimizer's update is -lr * (what it was given)
    return cfg(name="sgd", sgd_momentum=0.0, **kw)


# ----------------------------------------------------------------------------- pgs checkout

def _pgs_file(name):
    roots = [pathlib.Path("/work/corpus/palingenesis"),
             pathlib.Path(os.environ.get("JAXTRAIN_UPSTREAM", "/nonexistent")) / "palingenesis"]
    for root in roots:
        path = root / "src" / "palingenesis" / name
        if path.is_file():
            return path
    return None


def _load(name):
    """One of palingenesis's modules, loaded by file path (its folder has a logging.py that
    would shadow the standard library's on sys.path)."""
    path = _pgs_file(name)
    if path is None:
        pytest.skip("no palingenesis checkout (/work/corpus or $JAXTRAIN_UPSTREAM)")
    pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location(f"_pgs_{name[:-3]}_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pgs_optim():
    return _load("optim.py")


@pytest.fixture(scope="module")
def pgs_perf():
    return _load("perf.py")


def torch_model(named: dict[str, np.ndarray]):
    """A torch module whose named_parameters are ``named`` (float32), in that order."""
    import torch
    root = torch.nn.Module()
    for name, value in named.items():
        *mods, leaf = name.split(".")
        m = root
        for part in mods:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(torch.tensor(value, dtype=torch.float32)))
    return root


def set_grads(model, grads: dict[str, np.ndarray]):
    import torch
    for name, p in model.named_parameters():
        p.grad = torch.tensor(grads[name], dtype=torch.float32)


def torch_params(model, what="data"):
    return {n: (p.grad if what == "grad" else p.data).double().numpy().copy()
            for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------- AdaGC

def np_adagc(grads_list, lam, beta, warmup, max_norm):
    """pgs's AdaGC.clip on the torch view, step t = 0, 1, ...: (clipped grads, EMA) per step."""
    ema, outs, emas = {}, [], []
    for t, grads in enumerate(grads_list):
        g = {k: v.copy() for k, v in grads.items()}
        if t < warmup:
            for k, v in g.items():
                n = np.linalg.norm(v)
                ema[k] = n if k not in ema else max(ema[k], n)
            total = np.sqrt(sum(np.sum(v * v) for v in g.values()))
            coef = min(1.0, max_norm / (total + 1e-6))
            g = {k: v * coef for k, v in g.items()}
        else:
            for k, v in g.items():
                n = np.linalg.norm(v)
                if n < 1e-12:
                    continue
                e = ema.get(k, n)
                limit = lam * e
                clipped = n
                if n > limit:
                    g[k] = v * (limit / n)
                    clipped = limit
                ema[k] = beta * e + (1 - beta) * clipped
        outs.append(g)
        emas.append(dict(ema))
    return outs, emas


def spiky_grads(n=7, spike_at=4):
    base = tree(10, 0.1)   # steady norms, so that only the spike is clipped
    grads = [jax.tree.map(lambda b, x: b + x, base, tree(20 + s, 0.01)) for s in range(n)]
    wi = grads[spike_at]["layers"]["mlp"]["wi"]
    grads[spike_at]["layers"]["mlp"]["wi"] = wi.at[:, 1].multiply(20.0)  # layer 1 spikes
    bo = grads[spike_at + 1]["layers"]["mlp"]["bo"]
    grads[spike_at + 1]["layers"]["mlp"]["bo"] = bo.at[:, 2].set(0.0)  # a tensor with no grad
    return grads


@pytest.mark.slow
def test_adagc_matches_pgs_formula_through_warmup_and_clipping():
    grads = spiky_grads()
    lam, beta, warm, max_norm = 1.5, 0.9, 3, 0.5
    outs, _ = run_steps(pgs_extras.adagc(PLAN, lam, beta, warm, max_norm), tree(0), grads)
    want, emas = np_adagc([torch_view(g) for g in grads], lam, beta, warm, max_norm)
    for got, ref in zip(outs, want):
        close(torch_view(got), ref, rtol=2e-5, atol=1e-7)
    # the warm-up clips the global norm; after it, the spiking tensor lands on lam * EMA
    assert np.sqrt(sum(np.sum(v * v) for v in torch_view(outs[0]).values())) == pytest.approx(
        max_norm, rel=1e-4)
    spiked = "model.layers.1.mlp.up_proj.weight"
    assert np.linalg.norm(torch_view(outs[4])[spiked]) == pytest.approx(lam * emas[3][spiked],
                                                                       rel=1e-5)
    assert emas[5]["model.layers.2.mlp.down_proj.bias"] == emas[4][
        "model.layers.2.mlp.down_proj.bias"]   # a zero gradient leaves its EMA alone
    # the other tensors of the spike step pass unclipped (a global clip would scale them all)
    for k in ("model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight"):
        np.testing.assert_allclose(torch_view(outs[4])[k], torch_view(grads[4])[k], rtol=1e-6)


@pytest.mark.slow
def test_adagc_without_warmup_starts_each_ema_at_its_own_norm():
    grads = spiky_grads(n=6, spike_at=3)
    outs, _ = run_steps(pgs_extras.adagc(PLAN, 1.2, 0.5, 0, 1.0), tree(0), grads)
    want, _ = np_adagc([torch_view(g) for g in grads], 1.2, 0.5, 0, 1.0)
    close(torch_view(outs[0]), torch_view(grads[0]), rtol=1e-6)   # nothing to clip against yet
    for got, ref in zip(outs, want):
        close(torch_view(got), ref, rtol=2e-5, atol=1e-7)


def test_adagc_replaces_the_global_clip_in_build_optimizer():
    """train.adagc on: per-tensor clipping after the warm-up; off: clip_grad's global clip."""
    grads = spiky_grads()
    on = sgd_cfg(clip_grad=0.5, adagc=True, adagc_lambda=1.5, adagc_beta=0.9,
                 adagc_warmup_steps=3)
    ups, _ = run_steps(build_optimizer(on, 1.0, AXES), tree(0), grads)
    want, _ = np_adagc([torch_view(g) for g in grads], 1.5, 0.9, 3, 0.5)
    for got, ref in zip(ups, want):
        close({k: -v for k, v in torch_view(got).items()}, ref, rtol=2e-5, atol=1e-7)
    off, _ = run_steps(build_optimizer(sgd_cfg(clip_grad=0.5), 1.0, AXES), tree(0), grads)
    k = "model.layers.0.mlp.up_proj.weight"   # unclipped under AdaGC, scaled by the global clip
    assert np.linalg.norm(torch_view(off[4])[k]) < 0.5 * np.linalg.norm(torch_view(ups[4])[k])


def test_adagc_warmup_is_the_lr_warmup_of_the_schedule():
    sched = make_lr_schedule(ScheduleConfig(family="pgs", style="cosine", lr=1e-3, warmup=7.0,
                                            decay=100.0))
    assert warmup_steps_of(sched) == 7 and warmup_steps_of(lambda c: 1e-3) is None
    megatron = dict(family="megatron", style="cosine", lr=1e-3, warmup=10.0, decay=100.0,
                    global_batch_size=4)   # warm-up in samples: the updates begun before 10
    assert warmup_steps_of(make_lr_schedule(ScheduleConfig(**megatron))) == 3
    ramped = ScheduleConfig(**megatron, rampup=(2, 2, 8))   # batches 2, 2, 2, 2, 4, ...
    assert warmup_steps_of(make_lr_schedule(ramped)) == 5
    opt = build_optimizer(sgd_cfg(adagc=True, clip_grad=1.0), sched, AXES)
    assert opt.init(tree(0))[0].count == 0
    with pytest.raises(ValueError, match="adagc_warmup_steps"):
        build_optimizer(sgd_cfg(adagc=True), lambda c: 1e-3, AXES)


def test_adagc_against_pgs_torch(pgs_perf):
    grads = spiky_grads()
    lam, beta, warm, max_norm = 1.5, 0.9, 3, 0.5
    outs, _ = run_steps(pgs_extras.adagc(PLAN, lam, beta, warm, max_norm), tree(0), grads)
    model = torch_model(torch_view(tree(0)))
    adagc = pgs_perf.AdaGC(model, lambda_rel=lam, beta=beta, warmup_steps=warm,
                           global_max_norm=max_norm)
    for t, (g, got) in enumerate(zip(grads, outs)):
        set_grads(model, torch_view(g))
        adagc.clip(t)
        close(torch_view(got), torch_params(model, "grad"), rtol=2e-5, atol=1e-7)
    assert adagc.total_clips >= 1


# ----------------------------------------------------------------------------- LLRD

def llrd_factor(name, d):
    if "embed" in name:
        return d ** (L + 1)
    if name.startswith("model.layers."):
        return d ** (L - int(name.split(".")[2]))
    return 1.0


def test_llrd_factor_per_layer_embedding_and_head():
    d = 0.8
    g = tree(1)
    (u,), _ = run_steps(build_optimizer(sgd_cfg(llrd_decay=d), 0.1, AXES), tree(0), [g])
    got, grad = torch_view(u), torch_view(g)
    want = {k: -0.1 * llrd_factor(k, d) * v for k, v in grad.items()}
    close(got, want, rtol=1e-6)
    assert got["model.layers.0.mlp.up_proj.weight"][0, 0] / grad[
        "model.layers.0.mlp.up_proj.weight"][0, 0] == pytest.approx(-0.1 * d ** 3)
    (plain,), _ = run_steps(build_optimizer(sgd_cfg(), 0.1, AXES), tree(0), [g])
    assert not np.allclose(torch_view(plain)["model.embed_tokens.weight"],
                           got["model.embed_tokens.weight"])


def test_llrd_numbers_layers_across_dense_and_moe_stacks():
    axes = {"embedding": P("vocab", "embed"),
            "layers": {"w": P("embed", "layers", "mlp")},
            "moe_layers": {"w": P("embed", "layers", "mlp")}}
    plan = leaf_plan(axes)
    params = {"embedding": jnp.ones((V, D)), "layers": {"w": jnp.ones((D, 2, F))},
              "moe_layers": {"w": jnp.ones((D, 1, F))}}
    f = pgs_extras.llrd_factors(plan, params, 0.5, ("layers", "moe_layers", "layers"))
    np.testing.assert_allclose(np.ravel(f["layers"]["w"]), [0.5 ** 3, 0.5 ** 1])
    np.testing.assert_allclose(np.ravel(f["moe_layers"]["w"]), [0.5 ** 2])
    assert float(f["embedding"]) == 0.5 ** 4
    with pytest.raises(ValueError, match="layer_stacks"):
        pgs_extras.llrd_factors(plan, params, 0.5)
    # from a config: num_experts with moe_layer_freq [0,1,0] gives that order
    c = load_config(None, ["train.llrd_decay=0.5", "num_layers=3", "num_experts=4",
                           "moe_layer_freq=[0,1,0]"], enforce_status=False)
    assert OptimConfig.from_config(c).layer_stacks == ("layers", "moe_layers", "layers")
    # Gemma 4's global layers (every third layer has no window) are a stack of their own
    c = load_config(None, ["train.llrd_decay=0.5", "num_layers=6", "window_size=[3,0]",
                           "window_attn_skip_freq=3", "global_kv_channels=16"],
                    enforce_status=False)
    assert OptimConfig.from_config(c).layer_stacks == ("layers", "layers", "global_layers") * 2


def np_adamw_groups(params, grads_list, lrs, b1, b2, eps, wd, decays, lr_mult):
    """torch AdamW over named tensors, per-tensor LR factor and decay (pgs's param groups)."""
    p = {k: v.copy() for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v2 = {k: np.zeros_like(v) for k, v in p.items()}
    for t, (g, lr) in enumerate(zip(grads_list, lrs), start=1):
        for k in p:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v2[k] = b2 * v2[k] + (1 - b2) * g[k] ** 2
            lr_k = lr * lr_mult(k)
            p[k] = p[k] * (1 - lr_k * wd(t - 1) * decays(k)) - lr_k * (m[k] / (1 - b1 ** t)) / (
                np.sqrt(v2[k] / (1 - b2 ** t)) + eps)
    return p


def pgs_decays(name, llrd=False):
    """pgs's AdamW groups: no decay for 1-D tensors, biases, norms, and (without LLRD) for the
    embeddings."""
    if "bias" in name or "norm" in name or "layernorm" in name:
        return 0.0
    if "embed" in name:
        return 1.0 if llrd else 0.0
    return 1.0


def test_llrd_adamw_matches_pgs_groups_including_embedding_decay():
    params, grads = tree(0), [tree(s, 0.1) for s in range(1, 5)]
    sched = lambda c: 1e-2 * jnp.minimum(1.0, (c + 1) / 3.0)  # noqa: E731
    oc = cfg(name="adamw", flavour="pgs", adam_beta2=0.95, weight_decay=0.3, llrd_decay=0.7)
    _, hist = run_steps(build_optimizer(oc, sched, AXES), params, grads)
    want = np_adamw_groups(torch_view(params), [torch_view(g) for g in grads],
                           [float(sched(c)) for c in range(4)], 0.9, 0.95, 1e-8,
                           lambda t: 0.3, lambda k: pgs_decays(k, llrd=True),
                           lambda k: llrd_factor(k, 0.7))
    close(torch_view(hist[-1]), want, rtol=1e-5, atol=1e-7)


def test_llrd_groups_against_pgs_torch(pgs_optim):
    import torch
    params, grads = tree(0), [tree(s, 0.1) for s in range(1, 4)]
    model = torch_model(torch_view(params))
    opt = pgs_optim.build_optimizer(model, 1e-2, 0.3, llrd_decay=0.7)
    lr_of = {}
    for group in opt.param_groups:
        for p in group["params"]:
            lr_of[id(p)] = group["lr"]
    for name, p in model.named_parameters():   # pgs's group LRs are lr times our factors
        assert lr_of[id(p)] == pytest.approx(1e-2 * llrd_factor(name, 0.7)), name
    for g in grads:
        set_grads(model, torch_view(g))
        opt.step()
    oc = cfg(name="adamw", flavour="pgs", adam_beta2=0.95, weight_decay=0.3, llrd_decay=0.7)
    _, hist = run_steps(build_optimizer(oc, 1e-2, AXES), params, grads)
    with torch.no_grad():
        close(torch_view(hist[-1]), torch_params(model), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- AdamC

def test_adamc_scales_weight_decay_with_the_lr_schedule():
    params, grads = tree(0, 2.0), [tree(s, 0.1) for s in range(1, 7)]
    peak = 1e-2
    sched = lambda c: peak * jnp.maximum(0.1, 1.0 - c / 5.0)  # noqa: E731
    lrs = [float(sched(c)) for c in range(6)]
    oc = cfg(name="adamw", flavour="pgs", adam_beta2=0.95, weight_decay=0.5, adamc=True, lr=peak)
    _, hist = run_steps(build_optimizer(oc, sched, AXES), params, grads)
    want = np_adamw_groups(torch_view(params), [torch_view(g) for g in grads], lrs, 0.9, 0.95,
                           1e-8, lambda t: 0.5 * lrs[t] / peak, pgs_decays, lambda k: 1.0)
    close(torch_view(hist[-1]), want, rtol=1e-5, atol=1e-7)
    plain = np_adamw_groups(torch_view(params), [torch_view(g) for g in grads], lrs, 0.9, 0.95,
                            1e-8, lambda t: 0.5, pgs_decays, lambda k: 1.0)
    k = "model.layers.0.mlp.up_proj.weight"   # decays less than plain AdamW as the LR falls
    assert np.abs(want[k] - plain[k]).max() > 1e-4
    _, off = run_steps(build_optimizer(cfg(name="adamw", flavour="pgs", adam_beta2=0.95,
                                           weight_decay=0.5, lr=peak), sched, AXES),
                       params, grads)
    close(torch_view(off[-1]), plain, rtol=1e-5, atol=1e-7)


def test_adamc_against_pgs_torch(pgs_optim):
    """pgs's AdamW + LambdaLR + AdamCCorrection without warm-up; with a warm-up pgs's code
    measures the peak LR as 0 and leaves the decay unchanged (jaxtrain does not copy that)."""
    import torch
    n, peak = 6, 1e-2
    params, grads = tree(0, 2.0), [tree(s, 0.1) for s in range(1, n + 1)]
    model = torch_model(torch_view(params))
    opt = pgs_optim.build_optimizer(model, peak, 0.5)
    sched = pgs_optim.build_scheduler(opt, "cosine", n, 0.0, 0.1)
    adamc = pgs_optim.AdamCCorrection(opt, peak)
    for g in grads:
        set_grads(model, torch_view(g))
        opt.step()
        sched.step()
        adamc.step()
    ours = make_lr_schedule(ScheduleConfig(family="pgs", style="cosine", lr=peak,
                                           min_lr=0.1 * peak, warmup=0.0, decay=float(n)))
    oc = cfg(name="adamw", flavour="pgs", adam_beta2=0.95, weight_decay=0.5, adamc=True, lr=peak)
    _, hist = run_steps(build_optimizer(oc, ours, AXES), params, grads)
    with torch.no_grad():
        close(torch_view(hist[-1]), torch_params(model), rtol=1e-5, atol=1e-6)

    warm = torch.optim.AdamW(torch_model(torch_view(params)).parameters(), lr=peak,
                             weight_decay=0.5)
    warm_sched = pgs_optim.build_scheduler(warm, "cosine", n, 0.5, 0.1)
    warm_adamc = pgs_optim.AdamCCorrection(warm, peak)
    for _ in range(n - 1):
        warm.step()   # no gradients: moves nothing
        warm_sched.step()
        warm_adamc.step()
    assert warm.param_groups[0]["lr"] < peak and warm.param_groups[0]["weight_decay"] == 0.5


# ----------------------------------------------------------------------------- Hyperball

def np_hyperball(params, grads_list, lrs, peak, wd, angular_lr=0.0, b1=0.9, b2=0.95, eps=1e-8):
    """pgs's Hyperball over torch AdamW: the constrained matrices take the base step without
    weight decay, then ``W = R normalize(W + eta_t R dW / |dW|)``; the rest is plain AdamW."""
    p = {k: v.copy() for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v2 = {k: np.zeros_like(v) for k, v in p.items()}
    radius, eta = {}, {}
    for t, (g, lr) in enumerate(zip(grads_list, lrs), start=1):
        s = lr / peak
        for k in p:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v2[k] = b2 * v2[k] + (1 - b2) * g[k] ** 2
            u = (m[k] / (1 - b1 ** t)) / (np.sqrt(v2[k] / (1 - b2 ** t)) + eps)
            if not k.endswith(CONSTRAINED):
                p[k] = p[k] * (1 - lr * wd * pgs_decays(k)) - lr * u
                continue
            w = p[k]
            radius.setdefault(k, np.linalg.norm(w))
            dw = -lr * u
            dn = np.linalg.norm(dw)
            if k not in eta:
                if angular_lr:
                    eta[k] = angular_lr
                elif s <= 0 or dn == 0:
                    continue
                else:
                    eta[k] = dn / radius[k] / s
            trial = w + dw * (eta[k] * s * radius[k] / max(dn, 1e-30))
            p[k] = trial * (radius[k] / np.linalg.norm(trial))
    return p, radius, eta


HB_PEAK = 1e-2


def hb_sched(c):   # LR 0 at step 0 (pgs's warm-up), then up and down
    return HB_PEAK * jnp.minimum(1.0, c / 2.0) * jnp.maximum(0.2, 1.0 - c / 8.0)


@pytest.mark.parametrize("angular_lr", [0.0, 0.05])
def test_hyperball_matches_pgs_and_keeps_initial_norms(angular_lr):
    params, grads = tree(0), [tree(s, 0.1) for s in range(1, 7)]
    lrs = [float(hb_sched(c)) for c in range(6)]
    oc = cfg(name="adamw", flavour="pgs", adam_beta2=0.95, weight_decay=0.3, hyperball=True,
             hyperball_lr=angular_lr, lr=HB_PEAK)
    opt = build_optimizer(oc, hb_sched, AXES)
    _, hist = run_steps(opt, params, grads)
    want, radius, eta = np_hyperball(torch_view(params), [torch_view(g) for g in grads], lrs,
                                     HB_PEAK, 0.3, angular_lr)
    close(torch_view(hist[-1]), want, rtol=2e-5, atol=1e-6)
    start = torch_view(params)
    for after in hist:
        view = torch_view(after)
        for k in view:
            if k.endswith(CONSTRAINED):
                assert np.linalg.norm(view[k]) == pytest.approx(np.linalg.norm(start[k]),
                                                                rel=1e-5), k
    k = "model.layers.1.mlp.up_proj.weight"
    if angular_lr == 0:
        # step 0 has LR 0: nothing moves; the angle is measured at the next step
        np.testing.assert_array_equal(torch_view(hist[0])[k], start[k])
        state = opt.init(params)
        for g in grads[:2]:
            _, state = opt.update(g, state, params)
        hb = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(
            x, pgs_extras.HyperballState)) if isinstance(s, pgs_extras.HyperballState)][0]
        got_eta = np.ravel(hb.eta["layers"]["mlp"]["wi"])
        assert got_eta[1] == pytest.approx(eta[k], rel=1e-5)
    # the embeddings, norms, biases and head are plain AdamW, decay included
    assert not np.allclose(want["model.embed_tokens.weight"], start["model.embed_tokens.weight"])


def test_hyperball_off_lets_norms_drift():
    params, grads = tree(0), [tree(s, 0.1) for s in range(1, 5)]
    oc = cfg(name="adamw", flavour="pgs", adam_beta2=0.95, weight_decay=0.3, lr=HB_PEAK)
    _, hist = run_steps(build_optimizer(oc, hb_sched, AXES), params, grads)
    k = "model.layers.0.mlp.down_proj.weight"
    assert abs(np.linalg.norm(torch_view(hist[-1])[k]) / np.linalg.norm(torch_view(params)[k])
               - 1) > 1e-4


def test_hyperball_with_muon_keeps_norms_and_skips_decay():
    """Over Muon: the base step's direction (taken without its weight decay), moved by
    eta * R and put back on the sphere of radius R, layer by layer."""
    params, grads = tree(0), [tree(s, 0.1) for s in range(1, 4)]
    muon = dict(name="muon", flavour="pgs", muon_coefficients="jordan", muon_lr_mult=10.0,
                muon_scale_mode="shape_scaling", lr=1e-3)
    _, hist = run_steps(build_optimizer(cfg(**muon, weight_decay=0.5, hyperball=True,
                                            hyperball_lr=0.02), 1e-3, AXES), params, grads)
    w0 = np.asarray(params["layers"]["mlp"]["wi"], np.float64)
    for after in hist:
        np.testing.assert_allclose(np.linalg.norm(np.asarray(after["layers"]["mlp"]["wi"]),
                                                  axis=(0, 2)),
                                   np.linalg.norm(w0, axis=(0, 2)), rtol=1e-5)
    (base,), _ = run_steps(build_optimizer(cfg(**muon), 1e-3, AXES), params, grads[:1])
    dw = np.asarray(base["layers"]["mlp"]["wi"], np.float64)
    r = np.linalg.norm(w0, axis=(0, 2), keepdims=True)
    trial = w0 + 0.02 * r * dw / np.linalg.norm(dw, axis=(0, 2), keepdims=True)
    want = trial * r / np.linalg.norm(trial, axis=(0, 2), keepdims=True)
    np.testing.assert_allclose(np.asarray(hist[0]["layers"]["mlp"]["wi"]), want, rtol=1e-4,
                               atol=1e-6)


# ----------------------------------------------------------------------------- MONA

def np_mona(grads_list, beta):
    """pgs's MONAAcceleration (fp32 buffers) on the torch view: the >= 2-D tensors only."""
    alpha = -1.0 / (2 * (1 - beta))
    prev, accel, outs = {}, {}, []
    for step, grads in enumerate(grads_list):
        out = {}
        for k, g in grads.items():
            g = g.copy()
            if g.ndim >= 2:
                if step > 0:
                    accel[k] = beta * accel.get(k, 0.0) + (1 - beta) * (g - prev[k])
                    g = g + alpha * accel[k]
                prev[k] = g
            out[k] = g
        outs.append(out)
    return outs


def test_mona_matches_pgs_formula_on_matrices_only():
    grads = [tree(s, 0.1) for s in range(1, 6)]
    outs, _ = run_steps(build_optimizer(sgd_cfg(mona=True, mona_beta_a=0.9, mona_lite=False),
                                        -1.0, AXES), tree(0), grads)
    want = np_mona([torch_view(g) for g in grads], 0.9)
    for got, ref in zip(outs, want):
        close(torch_view(got), ref, rtol=1e-5, atol=1e-6)
    close(torch_view(outs[0]), torch_view(grads[0]), rtol=1e-7)   # the first step is plain
    got = torch_view(outs[3])
    assert np.array_equal(got["model.layers.0.mlp.down_proj.bias"],
                          torch_view(grads[3])["model.layers.0.mlp.down_proj.bias"])
    assert not np.allclose(got["model.layers.0.mlp.up_proj.weight"],
                           torch_view(grads[3])["model.layers.0.mlp.up_proj.weight"])


def test_mona_state_and_lite_buffers():
    grads = [tree(s, 0.1) for s in range(1, 4)]
    for lite, dtype in ((True, jnp.bfloat16), (False, jnp.float32)):
        opt = pgs_extras.mona(PLAN, 0.975, lite)
        state = opt.init(tree(0))
        outs = []
        for g in grads:
            u, state = opt.update(g, state)
            outs.append(u)
        inner = state.inner_state
        assert int(inner.count) == 3
        assert inner.prev["layers"]["mlp"]["wi"].dtype == dtype
        assert isinstance(inner.prev["final_norm"]["scale"], optax.MaskedNode)
        # g_prev is the augmented gradient of the last step, A the EMA of differences
        np.testing.assert_allclose(np.asarray(inner.prev["output"], np.float32),
                                   np.asarray(outs[-1]["output"]).astype(dtype).astype(np.float32),
                                   rtol=1e-6)
    ref = np_mona([torch_view(g) for g in grads], 0.975)
    close(torch_view(outs[-1]), ref[-1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lite", [False, True])
def test_mona_against_pgs_torch(pgs_optim, lite):
    grads = [tree(s, 0.1) for s in range(1, 6)]
    model = torch_model(torch_view(tree(0)))
    mona = pgs_optim.MONAAcceleration(model, beta_a=0.95, lite=lite)
    outs, _ = run_steps(pgs_extras.mona(PLAN, 0.95, lite), tree(0), grads)
    for g, got in zip(grads, outs):
        set_grads(model, torch_view(g))
        mona.apply()
        # bf16 buffers: torch rounds as jaxtrain does on its vectorised path, but its scalar
        # tail (tensors this small) also rounds (1 - b) * diff: a bf16 step of A apart, times
        # |alpha| = 10, in a few elements
        close(torch_view(got), torch_params(model, "grad"), rtol=1e-5,
              atol=1e-2 if lite else 1e-6)


# ----------------------------------------------------------------------------- end to end

PGS_YAML = """
    model: {name_or_path: null}
    train:
      optimizer: adamw
      learning_rate: 1.0e-3
      warmup_ratio: 0.25
      max_steps: 20
      weight_decay: 0.1
      max_grad_norm: 1.0
      spike_detection: false
      adagc: true
      adagc_lambda: 2.0
      adagc_beta: 0.8
      adamc: true
      llrd_decay: 0.9
      hyperball: true
      hyperball_lr: 0.01
      mona: true
      mona_beta_a: 0.99
      mona_lite: false
    """


def state_kinds(state) -> set[str]:
    """The class names of the NamedTuple states nested in an optax state."""
    if isinstance(state, tuple):
        own = {type(state).__name__} if hasattr(state, "_fields") else set()
        return own.union(*(state_kinds(s) for s in state))
    if isinstance(state, dict):
        return set().union(*(state_kinds(s) for s in state.values()))
    return set()


@pytest.mark.slow
def test_pgs_config_builds_every_extra(write):
    from jaxtrain.models import ModelConfig, logical_axes
    c = load_config(write("pgs.yml", PGS_YAML), ["num_layers=2", "hidden_size=16",
                                                  "num_attention_heads=2", "ffn_hidden_size=32",
                                                  "vocab_size=32"], enforce_status=True)
    oc = OptimConfig.from_config(c)
    assert (oc.adagc, oc.adagc_lambda, oc.adagc_beta, oc.adamc, oc.llrd_decay) == (
        True, 2.0, 0.8, True, 0.9)
    assert (oc.hyperball, oc.hyperball_lr, oc.mona, oc.mona_beta_a, oc.mona_lite) == (
        True, 0.01, True, 0.99, False)
    sched = make_lr_schedule(ScheduleConfig.from_config(c, total_steps=20))
    assert warmup_steps_of(sched) == 5   # int(20 * 0.25): AdaGC's global-clip phase
    mc = ModelConfig.from_config(c)
    axes = logical_axes(mc)
    opt = build_optimizer(oc, sched, axes)
    from jaxtrain.models import init
    params = init(mc, jax.random.key(0))
    grads = jax.tree.map(lambda p: 0.01 * jnp.ones_like(p), params)
    state = opt.init(params)
    assert {"MonaState", "AdaGCState", "HyperballState"} <= state_kinds(state)
    step = jax.jit(opt.update)
    for _ in range(3):
        u, state = step(grads, state, params)
        params = optax.apply_updates(params, u)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))


def test_rules_refuse_what_pgs_would_ignore():
    for args, match in (
            (["train.optimizer=muon", "train.llrd_decay=0.9"], "train.llrd_decay = 0.9 with "
                                                              "train.optimizer = muon"),
            (["train.llrd_decay=0.9", "plugins.schedule_free=true"],
             "train.llrd_decay = 0.9 cannot be combined with plugins.schedule_free"),
            (["train.adamc=true", "plugins.schedule_free=true"],
             "train.adamc cannot be combined with plugins.schedule_free"),
            (["train.mona=true", "plugins.schedule_free=true"],
             "train.mona cannot be combined with plugins.schedule_free"),
            (["train.hyperball=true", "plugins.schedule_free=true"],
             "train.hyperball cannot be combined with plugins.schedule_free")):
        with pytest.raises(ConfigError, match=match):
            load_config(None, args, enforce_status=False)
    load_config(None, ["train.optimizer=adamw", "train.llrd_decay=0.9"], enforce_status=False)
    both = load_config(None, ["train.adagc=true", "train.spike_detection=true"],
                       enforce_status=False)
    assert any("train.adagc and train.spike_detection" in w for w in both.warnings)


def test_range_checks_name_the_knob():
    for kw, match in ((dict(llrd_decay=1.5), "train.llrd_decay"),
                      (dict(llrd_decay=0.0), "train.llrd_decay"),
                      (dict(mona_beta_a=1.0), "train.mona_beta_a"),
                      (dict(adagc_beta=1.0), "train.adagc_beta"),
                      (dict(adagc_lambda=0.0), "train.adagc_lambda"),
                      (dict(hyperball_lr=-0.1), "train.hyperball_lr")):
        with pytest.raises(ValueError, match=match):
            OptimConfig(**kw)
