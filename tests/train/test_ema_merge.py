"""pgs train.ema (train.ema_decay, train.ema_every) and train.base_merge (train.base_merge_ratio,
train.base_merge_every, train.base_merge_method): against NumPy re-implementations of pgs's
formulas, side by side with pgs's torch code, and through loop.train (final/ holds the EMA, a
resumed run continues the same EMA, the merge pulls the weights toward model.name_or_path's)."""
import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from safetensors.numpy import load_file
from sft_helpers import pair_task, write_chat_model, write_jsonl

from jaxtrain import averaging, loop, models
from jaxtrain.averaging import WeightAveraging, ema_decay_at, merge, slerp, slerp_layout
from jaxtrain.config import load_config
from jaxtrain.config.errors import ConfigError
from jaxtrain.train_config import TrainConfig
from tests.train.test_step import model_cfg, train_cfg


# ------------------------------------------------------------------ NumPy pgs


def np_ema(start, seq, decay, every, skipped=()):
    """pgs ModelEMA driven as its trainer drives it: ``seq[i]`` are the weights after step
    i + 1; an update at steps divisible by ``every`` (none after a skipped step), t counting
    the updates."""
    shadow, t = np.asarray(start, np.float64), 0
    for it, p in enumerate(seq, 1):
        if it % every or it in skipped:
            continue
        t += 1
        d = min(decay, 1 - 1 / (t + 1))
        shadow = d * shadow + (1 - d) * np.asarray(p, np.float64)
    return shadow


def np_lerp(a, b, r):
    return a + r * (b - a)


def np_slerp(a, b, r):
    """pgs _slerp on one tensor, flattened."""
    a64, b64 = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    na, nb = np.linalg.norm(a64), np.linalg.norm(b64)
    if na < 1e-8 or nb < 1e-8:
        return np_lerp(a, b, r)
    cos = np.clip(a64 @ b64 / (na * nb), -1, 1)
    if abs(cos) > 0.9999:
        return np_lerp(a, b, r)
    w = np.arccos(cos)
    return ((np.sin((1 - r) * w) * a64 + np.sin(r * w) * b64) / np.sin(w)).reshape(np.shape(a))


def np_merge_hf(weights: dict, base: dict, r, method):
    """pgs BaseModelMerge over Hugging Face tensors: base in fp16, slerp on >= 2-D tensors."""
    out = {}
    for name, a in weights.items():
        b = base[name].astype(np.float16).astype(np.float32)
        out[name] = (np_slerp(a, b, r) if method == "slerp" and a.ndim >= 2
                     else np_lerp(a, b, r))
    return out


# ------------------------------------------------------------------ EMA


def test_ema_decay_ramps_to_its_cap():
    got = [float(ema_decay_at(0.9, t)) for t in (1, 2, 3, 9, 10, 100)]
    np.testing.assert_allclose(got, [0.5, 2 / 3, 0.75, 0.9, 0.9, 0.9], rtol=1e-6)


def _single_device(tree):
    s = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("d",)), P())
    return jax.tree.map(lambda _: s, tree), s


def _averaging(mcfg, **tcfg):
    abstract = models.abstract(mcfg)
    shardings, repl = _single_device(abstract)
    return WeightAveraging(train_cfg(**tcfg), mcfg, abstract, shardings, repl,
                           jax.devices()[0])


@pytest.mark.parametrize("every", [1, 3])
def test_ema_every_and_decay_follow_pgs(every):
    """train.ema_every, train.ema_decay: over 10 steps with a skipped one, the shadow is pgs's
    (decay 0.7: the ramp 0.5, 0.667 and then the cap)."""
    mcfg = model_cfg()
    avg = _averaging(mcfg, ema_decay=0.7, ema_every=every)
    start = models.init(mcfg, jax.random.key(0))
    avg.start(start, {})
    rng = np.random.default_rng(every)
    seq, params = [], start
    for it in range(1, 11):
        skipped = it == 6
        if not skipped:   # a skipped step leaves the weights as they were
            params = jax.tree.map(lambda p: p + jnp.asarray(rng.normal(size=p.shape),
                                                            p.dtype), params)
        seq.append(params)
        avg.after_step(it, params, jnp.bool_(skipped))
    assert int(avg.ema["count"]) == len([i for i in range(1, 11) if i % every == 0 and i != 6])
    assert {x.sharding.memory_kind for x in jax.tree.leaves(avg.ema["params"])} == {
        averaging.host_memory_kind(jax.devices()[0])}
    leaves = lambda tree: [np.asarray(x) for x in jax.tree.leaves(tree)]  # noqa: E731
    steps = [leaves(s) for s in seq]
    for i, (got, first) in enumerate(zip(leaves(avg.ema["params"]), leaves(start))):
        want = np_ema(first, [s[i] for s in steps], 0.7, every, skipped={6})
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ merge


def test_slerp_keeps_norms_and_falls_back_to_lerp():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(6, 5)).astype(np.float32)
    b = rng.normal(size=(6, 5)).astype(np.float32)
    b *= np.linalg.norm(a) / np.linalg.norm(b)                     # equal norms
    for r in (0.1, 0.5, 0.9):
        got = np.asarray(slerp(jnp.asarray(a), jnp.asarray(b), r))
        np.testing.assert_allclose(got, np_slerp(a, b, r), rtol=1e-5, atol=1e-6)
        assert np.linalg.norm(got) == pytest.approx(np.linalg.norm(a), rel=1e-5)
        assert np.linalg.norm(np_lerp(a, b, r)) < 0.99 * np.linalg.norm(a)   # lerp shrinks
    near = a * 1.01 + 1e-5 * rng.normal(size=a.shape).astype(np.float32)  # |cos| > 0.9999
    for other in (near, -a, np.zeros_like(a)):
        np.testing.assert_allclose(np.asarray(slerp(jnp.asarray(a), jnp.asarray(other), 0.3)),
                                   np_lerp(a, other, 0.3), rtol=1e-6, atol=1e-7)
    stacked = np.stack([a, b * 0.5, near])                  # per slice along a batch axis
    got = np.asarray(slerp(jnp.asarray(stacked), jnp.asarray(stacked[::-1]), 0.4, (0,)))
    for i in range(3):
        np.testing.assert_allclose(got[i], np_slerp(stacked[i], stacked[2 - i], 0.4),
                                   rtol=1e-5, atol=1e-6)


def test_which_weights_are_matrices():
    assert slerp_layout(("embed", "layers", "q_heads", "kv")) == ((1,), True)    # q_proj
    assert slerp_layout(("q_heads", "layers", "kv")) == ((1,), False)            # q_proj.bias
    assert slerp_layout(("layers", "exp", "embed", "mlp")) == ((0, 1), True)     # an expert
    assert slerp_layout(("layers", "exp", "mlp")) == ((0, 1), False)
    assert slerp_layout(("norm", "layers")) == ((1,), False)
    assert slerp_layout(("vocab", "embed")) == ((), True)


MATRICES = ("wq", "wk", "wv", "wo", "wi_0", "wi_1", "embedding", "output")


@pytest.mark.parametrize("method", ["lerp", "slerp"])
@pytest.mark.slow
def test_merge_is_pgs_per_layer(method):
    """train.base_merge_method, train.base_merge_ratio: each layer's matrix slerps on its own,
    vectors (norms, biases) lerp; the base is rounded to fp16."""
    mcfg = model_cfg(add_qkv_bias=True)
    params = models.init(mcfg, jax.random.key(0))
    base = jax.tree.map(lambda p: p + 0.05 * jax.random.normal(jax.random.key(3), p.shape),
                        models.init(mcfg, jax.random.key(1)))
    got = merge(params, base, 0.3, method, models.logical_axes(mcfg))
    L, axis = mcfg.num_layers, mcfg.param_scan_axis
    for path, a in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = [k.key for k in path]
        b = np.asarray(_at(base, keys)).astype(np.float16).astype(np.float32)
        out, a = np.asarray(_at(got, keys)), np.asarray(a)
        slices = range(L) if keys[0] == "layers" else [None]
        for i in slices:
            take = (lambda x: x) if i is None else (lambda x: np.take(x, i, axis))  # noqa: E731
            f = np_slerp if method == "slerp" and keys[-1] in MATRICES else np_lerp
            np.testing.assert_allclose(take(out), f(take(a), take(b), 0.3), rtol=2e-5,
                                       atol=1e-6, err_msg=str(keys))


def _at(tree, keys):
    for k in keys:
        tree = tree[k]
    return tree


def test_merge_every_and_pre_rl_base_reuse():
    """train.base_merge_every: merges at its multiples only; a base tree handed over (plugins.
    pre_rl's) is used as is, nothing loaded."""
    mcfg = model_cfg()
    avg = _averaging(mcfg, base_merge_ratio=0.5, base_merge_every=2)
    params = models.init(mcfg, jax.random.key(0))
    base = models.init(mcfg, jax.random.key(1))
    avg.start(params, {}, base_dir=None, base=base)
    assert avg.ema is None and avg.items() == {}
    kept = avg.merge_due(1, params)
    assert kept is params
    merged = avg.merge_due(2, jax.tree.map(jnp.copy, params))
    np.testing.assert_allclose(np.asarray(merged["embedding"]),
                               np_lerp(np.asarray(params["embedding"]),
                                       np.asarray(base["embedding"]).astype(np.float16)
                                       .astype(np.float32), 0.5), rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ pgs's own code


@pytest.fixture(scope="module")
def pgs_perf():
    path = pathlib.Path("/work/corpus/palingenesis/src/palingenesis/perf.py")
    if not path.is_file():
        pytest.skip("no palingenesis checkout")
    torch = pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("_pgs_perf_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, torch


def test_same_ema_and_merge_as_pgs(pgs_perf):
    module, torch = pgs_perf
    rng = np.random.default_rng(0)
    shapes = {"w": (5, 7), "b": (7,)}
    net = torch.nn.Module()
    for k, s in shapes.items():
        net.register_parameter(k, torch.nn.Parameter(torch.tensor(rng.normal(size=s),
                                                                  dtype=torch.float32)))
    ours = averaging.ema_init({k: jnp.asarray(v.detach().numpy()) for k, v in
                               net.named_parameters()})
    ema = module.ModelEMA(net, decay=0.8)
    for it in range(1, 9):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.tensor(rng.normal(size=p.shape), dtype=torch.float32))
        if it % 2 == 0:
            ema.update()
            ours = averaging.ema_update(ours, {k: jnp.asarray(v.detach().numpy())
                                               for k, v in net.named_parameters()}, 0.8)
    for k in shapes:
        np.testing.assert_allclose(np.asarray(ours["params"][k]), ema._shadow[k].numpy(),
                                   rtol=1e-6, atol=1e-6)
    axes = {"w": P("embed", "mlp"), "b": P("mlp")}
    for method in ("lerp", "slerp"):
        base = {k: v.detach().numpy().copy() for k, v in net.named_parameters()}
        merger = module.BaseModelMerge(net, merge_ratio=0.3, method=method)
        with torch.no_grad():
            for p in net.parameters():
                p.mul_(1.5).add_(torch.tensor(rng.normal(size=p.shape), dtype=torch.float32))
        now = {k: jnp.asarray(v.detach().numpy()) for k, v in net.named_parameters()}
        merger.merge_step()
        got = merge(now, base, 0.3, method, axes)
        for k in shapes:
            np.testing.assert_allclose(np.asarray(got[k]), dict(net.named_parameters())[k]
                                       .detach().numpy(), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ config


def _config(tmp_path, model_dir, data, *extra, steps=4, out="out"):
    path = tmp_path / "pgs.yml"
    path.write_text(f"model: {{name_or_path: {model_dir}, torch_dtype: float32}}\n"
                    f"data: {{max_seq_length: 64, dataset: {data}}}\n"
                    f"train: {{max_steps: {steps}, per_device_batch_size: 2, "
                    "gradient_accumulation_steps: 1, output_dir: " + str(tmp_path / out)
                    + ", warmup_ratio: 0, learning_rate: 0.005, save_steps: 1, save_final: true}\n"
                    "logging: {use_wandb: false, use_trackio: false}\n")
    return load_config(path, list(extra), world_size=1, enforce_status=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_chat_model(tmp_path_factory.mktemp("m") / "model", attention_bias=True,
                            mlp_bias=True)


def test_config_rules(tmp_path, model_dir):
    data = write_jsonl(tmp_path / "chat.jsonl", pair_task(4))
    for bad, message in (("train.ema_decay=1.5", "train.ema_decay = 1.5"),
                         ("train.ema_every=0", "train.ema_every = 0")):
        with pytest.raises(ConfigError, match=message):
            _config(tmp_path, model_dir, data, "train.ema=true", bad)
    with pytest.raises(ConfigError, match="train.base_merge_ratio = -0.1"):
        _config(tmp_path, model_dir, data, "train.base_merge=true", "train.base_merge_ratio=-0.1")
    _config(tmp_path, model_dir, data, "train.ema_decay=1.5")   # off: not checked
    path = tmp_path / "none.yml"
    path.write_text(f"model: {{name_or_path: null}}\ndata: {{dataset: {data}}}\n"
                    "train: {base_merge: true}\n")
    with pytest.raises(ConfigError, match="train.base_merge pulls the weights back"):
        TrainConfig.from_config(load_config(path, [f"tokenizer_model={model_dir}",
                                                   "train.max_steps=2"], world_size=1,
                                            enforce_status=False))


# ------------------------------------------------------------------ through the loop


def _hf(path) -> dict:
    return load_file(str(pathlib.Path(path) / "model.safetensors"))


@pytest.fixture(scope="module")
def plain(tmp_path_factory, model_dir):
    """A run without either: its weights after each step (step-N/model) and at the end."""
    tmp = tmp_path_factory.mktemp("plain")
    data = write_jsonl(tmp / "chat.jsonl", pair_task(8))
    loop.train(_config(tmp, model_dir, data))
    out = tmp / "out"
    return data, {n: _hf(out / f"step-{n}" / "model") for n in range(1, 5)}, _hf(out / "final")


@pytest.mark.slow
def test_final_holds_the_ema_and_a_resume_continues_it(tmp_path, model_dir, plain, caplog):
    """train.ema: killed after step 2 and resumed, final/ holds pgs's EMA (decay 0.6, every 2
    steps) of the uninterrupted run's weights; a resume that restarted the EMA would not."""
    data, steps, final = plain
    knobs = ("train.ema=true", "train.ema_decay=0.6", "train.ema_every=2")
    loop.train(_config(tmp_path, model_dir, data, *knobs, "exit_interval=2"))
    out = tmp_path / "out"
    assert not (out / "final").exists() and (out / "step_2" / "ema").is_dir()
    with caplog.at_level("INFO"):
        loop.train(_config(tmp_path, model_dir, data, *knobs, "train.resume_from=auto"))
    assert "continuing after update 1" in caplog.text
    assert "final model (EMA weights, train.ema) exported" in caplog.text
    got, start = _hf(out / "final"), _hf(model_dir)
    for name in start:
        np.testing.assert_allclose(_hf(out / "step-4" / "model")[name], steps[4][name],
                                   rtol=1e-5, atol=1e-6)          # training itself unchanged
        want = np_ema(start[name], [steps[n][name] for n in range(1, 5)], 0.6, 2)
        np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6, err_msg=name)
    name = "model.layers.0.mlp.up_proj.weight"
    restarted = np_ema(steps[2][name], [steps[n][name] for n in (3, 4)], 0.6, 2)
    every_step = np_ema(start[name], [steps[n][name] for n in range(1, 5)], 0.6, 1)
    for other in (restarted, every_step, final[name]):
        assert np.abs(got[name] - other).max() > 1e-4
    meta = json.loads((out / "step_4" / "meta" / "metadata").read_text())
    assert "ema" in meta["items"]


@pytest.mark.parametrize("method, every", [("lerp", 2), ("slerp", 1)])
@pytest.mark.slow
def test_merge_pulls_toward_the_pretrained_weights(tmp_path, model_dir, plain, method, every):
    """train.base_merge with train.base_merge_ratio 0.5: the weights saved at a merge step are
    pgs's merge of the unmerged run's with the fp16 base; before it, they are untouched. (The
    run stops there, exit_interval, with the 4-step run's LR schedule.)"""
    data, steps, _ = plain
    loop.train(_config(tmp_path, model_dir, data, "train.base_merge=true",
                       "train.base_merge_ratio=0.5", f"train.base_merge_every={every}",
                       f"train.base_merge_method={method}", f"exit_interval={every}"))
    out, start = tmp_path / "out", _hf(model_dir)
    want = np_merge_hf(steps[every], start, 0.5, method)
    got = _hf(out / f"step-{every}" / "model")
    assert got.keys() == want.keys() and "model.layers.0.self_attn.q_proj.bias" in got
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=2e-5, atol=1e-6, err_msg=name)
        if every == 2:
            np.testing.assert_allclose(_hf(out / "step-1" / "model")[name], steps[1][name],
                                       rtol=1e-5, atol=1e-6)
    name = "model.layers.1.self_attn.q_proj.weight"
    other = np_merge_hf({name: steps[every][name]}, start, 0.5,
                        "lerp" if method == "slerp" else "slerp")[name]
    assert np.abs(got[name] - other).max() > 1e-6          # the method matters
