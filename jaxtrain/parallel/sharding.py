"""One table from logical axis names to mesh axes, and every sharding derived from it.

Model code names logical axes only: parameters through their :class:`ParamSpec` axes,
activations through :func:`constrain`. :func:`axis_rules` is the single table that turns those
names into mesh axes for a :class:`MeshConfig`:

=================  ==========================  ==========================================
logical name       mesh axes                   what it is
=================  ==========================  ==========================================
vocab              tensor                      embedding rows / output columns (TP)
q_heads, kv_heads  tensor                      attention heads (column-parallel QKV,
                                               row-parallel output projection)
mlp                tensor                      MLP hidden (column then row parallel)
embed, kv, norm   -                           hidden size, head dim, norm scales
layers             pipeline                    the stacked layer axis (each pipeline rank
                                               holds its stages' layers when they divide)
exp                expert                      MoE experts (expert parallelism)
zero               data, expert                where ZeRO / FSDP shards over data parallel
act_batch          replica, data, expert       the batch of every activation
act_seq            context                     sequence inside attention and the MLP
act_res_seq        context (+ tensor with SP)  sequence of the residual stream: with
                                               sequence_parallel it is split over the
                                               tensor axis outside attention and the MLP
act_layer_seq      as act_res_seq (+ tensor    sequence of each layer's input, what full
                   with distribute_saved_      recompute saves for the backward
                   activations)
act_heads,         tensor                      activations of TP-split projections
act_kv_heads,
act_mlp, act_vocab
act_embed, act_kv  -
=================  ==========================  ==========================================

ZeRO / FSDP: a tensor sharded over data parallel puts the ``zero`` axes on its ``embed``
dimension, or if it has none (or that one is taken or does not divide) on its first free
dimension that divides. Optimizer state does so from stage 1 (``use_distributed_optimizer``),
gradients from stage 2, parameters at stage 3 (FSDP). A mesh axis is dropped from any
dimension it does not divide (the tensor is then replicated along it), and axes of size 1 are
left out of the specs so they read as what they mean.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxtrain.parallel.mesh import BATCH_AXES, MeshConfig

Rules = dict[str, tuple[str, ...]]


def axis_rules(mcfg: MeshConfig) -> Rules:
    """The logical-axis table for this layout (the module docstring shows it)."""
    seq = ("context",)
    res = seq + ("tensor",) if mcfg.sequence_parallel else seq
    return {
        "vocab": ("tensor",), "q_heads": ("tensor",), "kv_heads": ("tensor",),
        "mlp": ("tensor",), "embed": (), "kv": (), "norm": (), "layers": ("pipeline",),
        "lora": (),   # MLA latent rank (q_lora_rank, kv_lora_rank): small, kept whole
        "exp": ("expert",), "zero": ("data", "expert"),
        "act_batch": BATCH_AXES, "act_seq": seq,
        "act_res_seq": res,
        "act_layer_seq": seq + ("tensor",) if mcfg.distribute_saved_activations else res,
        "act_heads": ("tensor",), "act_kv_heads": ("tensor",), "act_mlp": ("tensor",),
        "act_vocab": ("tensor",), "act_embed": (), "act_kv": (),
    }


def _fit(axes, size: int, mesh_shape: dict, used: set) -> tuple[str, ...]:
    """The mesh axes of ``axes`` that are real (size > 1), unused so far and divide ``size``."""
    kept = []
    for axis in axes:
        n = mesh_shape[axis]
        if n > 1 and axis not in used and size % (math.prod(mesh_shape[a] for a in kept) * n) == 0:
            kept.append(axis)
    return tuple(kept)


def spec_for(names, shape, rules: Rules, mesh_shape: dict, over_data: bool = False) -> P:
    """PartitionSpec for a tensor of ``shape`` whose dimensions have logical ``names``;
    ``over_data`` also shards it over data parallel (ZeRO/FSDP, see the module docstring)."""
    used, parts = set(), []
    for name, size in zip(names, shape):
        axes = _fit(rules[name] if name is not None else (), size, mesh_shape, used)
        used.update(axes)
        parts.append(axes)
    if over_data:
        order = [i for i, n in enumerate(names) if n == "embed"]
        order += [i for i, n in enumerate(names) if n not in ("embed", "layers")]
        for i in order:
            if parts[i]:
                continue
            axes = _fit(rules["zero"], shape[i], mesh_shape, used)
            if axes and math.prod(mesh_shape[a] for a in axes) == math.prod(
                    mesh_shape[a] for a in rules["zero"] if a not in used):
                parts[i] = axes
                break
    return P(*[(a[0] if len(a) == 1 else a) if a else None for a in parts])


class Layout:
    """A mesh plus the table: shardings for parameters, optimizer state, gradients, batches."""

    def __init__(self, mesh: Mesh, mcfg: MeshConfig):
        self.mesh, self.mcfg = mesh, mcfg
        self.rules = axis_rules(mcfg)
        self.mesh_shape = dict(mesh.shape)

    def sharding(self, spec: P, memory_kind: str | None = None) -> NamedSharding:
        return NamedSharding(self.mesh, spec, memory_kind=memory_kind)

    def tree(self, logical, abstract, over_data: bool, memory_kind: str | None = None):
        """NamedShardings for ``abstract`` (ShapeDtypeStructs) with ``logical`` axis specs."""
        return jax.tree.map(
            lambda names, a: self.sharding(
                spec_for(tuple(names), a.shape, self.rules, self.mesh_shape, over_data),
                memory_kind),
            logical, abstract, is_leaf=lambda x: isinstance(x, P))

    def params(self, logical, abstract, memory_kind: str | None = None):
        """Parameter shardings: TP always, data-parallel sharded at stage 3 (FSDP)."""
        return self.tree(logical, abstract, self.mcfg.stage >= 3, memory_kind)

    def grads(self, logical, abstract):
        """Where the reduced gradients live: sharded over data parallel from stage 2."""
        return self.tree(logical, abstract, self.mcfg.stage >= 2)

    def gathered(self, logical, abstract):
        """Parameter shardings without the data-parallel split (FSDP's gathered weights)."""
        return self.tree(logical, abstract, False)

    def opt_state(self, state_abstract, logical, params_abstract, memory_kind=None):
        """Optimizer-state shardings: leaves shaped like a parameter (found by the parameter's
        path at the end of theirs) follow that parameter's axes, sharded over data parallel
        from stage 1; other leaves (counts, scalars, quantization blocks) are replicated."""
        by_path = {}
        for path, names in jax.tree_util.tree_flatten_with_path(
                logical, is_leaf=lambda x: isinstance(x, P))[0]:
            by_path[tuple(path)] = tuple(names)
        shapes = {tuple(p): a.shape for p, a in
                  jax.tree_util.tree_flatten_with_path(params_abstract)[0]}
        over_data = self.mcfg.stage >= 1

        def leaf(path, a):
            path = tuple(path)
            for n in range(len(path), 0, -1):
                names = by_path.get(path[-n:])
                if names is not None and shapes[path[-n:]] == a.shape:
                    return self.sharding(spec_for(names, a.shape, self.rules, self.mesh_shape,
                                                  over_data), memory_kind)
            return self.sharding(P(), memory_kind)

        return jax.tree_util.tree_map_with_path(leaf, state_abstract)

    def batch(self, leading: int = 1) -> NamedSharding:
        """Sharding of a [M, B, T] batch array (``leading`` unsharded axes before B)."""
        axes = tuple(a for a in BATCH_AXES if self.mesh_shape[a] > 1)
        return self.sharding(P(*([None] * leading), (axes[0] if len(axes) == 1 else axes)
                               if axes else None))

    def local_rows(self, rows: int) -> tuple[int, int]:
        """The rows (lo, hi) of a [M, rows, T] batch held by this process's devices: the only
        samples this process needs to read (contiguous, as devices are in process order)."""
        spans = sorted({(s[1].indices(rows)[0], s[1].indices(rows)[1]) for s in
                        self.batch().addressable_devices_indices_map((1, rows)).values()})
        lo, hi = spans[0]
        for a, b in spans[1:]:
            if a > hi:
                raise ValueError(f"this process's batch rows are not contiguous: {spans}")
            hi = max(hi, b)
        return lo, hi

    def put_batch(self, local: dict, rows: int) -> dict:
        """Global batch arrays [M, rows, T] from this process's rows (see :meth:`local_rows`)."""
        sharding = self.batch()
        return {k: jax.make_array_from_process_local_data(
                    sharding, v, (v.shape[0], rows, *v.shape[2:])) for k, v in local.items()}

    def replicated(self) -> NamedSharding:
        return self.sharding(P())

    @contextlib.contextmanager
    def activations(self):
        """Within this block (while tracing), :func:`constrain` applies this layout's table."""
        token = _ACTIVE.set(self)
        try:
            yield
        finally:
            _ACTIVE.reset(token)


_ACTIVE: contextvars.ContextVar[Layout | None] = contextvars.ContextVar("layout", default=None)


@contextlib.contextmanager
def no_layout():
    """Within this block :func:`constrain` pins nothing (code inside a ``shard_map`` that
    splits every mesh axis)."""
    token = _ACTIVE.set(None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_layout() -> Layout | None:
    """The layout of the enclosing :meth:`Layout.activations` block (None outside one); code
    that runs its own ``shard_map`` (the MoE dispatch) takes the mesh and table from it."""
    return _ACTIVE.get()


def nested_mesh(layout: Layout) -> dict:
    """``mesh`` (and ``axis_names``) for a ``shard_map`` over ``layout``'s mesh that may run
    inside another one manual over some axes (the pipeline executor's): there it must name
    the enclosing abstract mesh and only the axes still automatic."""
    context = jax.sharding.get_abstract_mesh()
    manual = set(getattr(context, "manual_axes", ()) or ())
    if context.empty or not manual:
        return {"mesh": layout.mesh}
    return {"mesh": context, "axis_names": set(context.axis_names) - manual}


def constrain(x, *names: str | None):
    """Pin activation ``x``'s sharding to logical ``names`` under the active layout (identity
    when none is active, e.g. in research code calling the model directly)."""
    layout = _ACTIVE.get()
    if layout is None:
        return x
    spec = spec_for(names, x.shape, layout.rules, layout.mesh_shape)
    return jax.lax.with_sharding_constraint(x, layout.sharding(spec))


def gather_weights(params: Any, logical: Any):
    """FSDP without ``reshard_after_forward``: the layer's weights gathered once and kept for
    the backward pass (the gathered copies become the saved residuals). Identity otherwise."""
    layout = _ACTIVE.get()
    if layout is None or layout.mcfg.stage < 3 or layout.mcfg.reshard_after_forward:
        return params
    return jax.tree.map(
        lambda names, x: jax.lax.with_sharding_constraint(
            x, layout.sharding(spec_for(tuple(names), x.shape, layout.rules, layout.mesh_shape))),
        logical, params, is_leaf=lambda x: isinstance(x, P))
