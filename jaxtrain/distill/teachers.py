"""Teachers at run time: a frozen JAX copy of a Hugging Face model (``backend: hf``) or a vLLM
server (``backend: vllm``), each turning micro-batches into what its loss reads.

An hf teacher's parameters are sharded on the student's mesh. With ``offload`` they wait in
host memory between scoring calls and come to the device for one call's micro-batches; the
output layer stays on the device (``full_rkl`` runs it inside the student's loss).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.checkpoint import hf_init
from jaxtrain.distill import scoring
from jaxtrain.distill.vllm_client import VLLMTeacher
from jaxtrain.models import abstract, logical_axes
from jaxtrain.models.hf import config_from_hf

HEAD_KEYS = ("embedding", "output")


class HFTeacher:
    def __init__(self, tplan, layout, dtype: str, loss):
        self.plan, self.loss = tplan, loss
        self.cfg = config_from_hf(tplan.config, dtype=dtype, weight_dtype=dtype)
        shapes = abstract(self.cfg)
        shardings = layout.params(logical_axes(self.cfg), shapes)
        params = hf_init.load_params(tplan.path, self.cfg, shapes, shardings)
        self.head = {k: v for k, v in params.items() if k in HEAD_KEYS}
        self.offload = tplan.spec.offload
        self._shardings = shardings
        if self.offload:   # host copies; the device copy lives only during a scoring call
            self.params = jax.tree.map(np.asarray, params)
            del params
        else:
            self.params = params

    def on_device(self):
        if not self.offload:
            return self.params
        return jax.tree.map(lambda a, s: jax.device_put(a, s), self.params, self._shardings)

    def features(self, batches: list[dict], key, items=None) -> list[dict]:
        """The loss inputs of each micro-batch (device arrays, computed in order)."""
        params, kind, shared = self.on_device(), self.plan.loss, (
            self.plan.bridge.shared if self.plan.bridge is not None else 0)
        out = [scoring.features(params, jax.tree.map(jnp.asarray, b), jax.random.fold_in(key, i),
                                cfg=self.cfg, kind=kind, top_k=self.loss.top_k,
                                rounds=self.loss.rs_rounds,
                                temperature=self.loss.rs_temperature, shared=shared,
                                to_student=self.plan.to_student)
               for i, b in enumerate(batches)]
        if self.offload:
            jax.block_until_ready(out)
            del params
        return out


class ServerTeacher:
    """A vLLM server's prompt log-probs as loss inputs (topk_kl, sampled_rkl, xtok)."""

    def __init__(self, tplan, loss):
        self.plan, self.loss, self.head, self.cfg = tplan, loss, None, None
        self.client = VLLMTeacher(tplan.spec.name, tplan.spec.model, tplan.spec.url, loss.top_k)
        self.client.check()

    def features(self, batches: list[dict], key, items: list[list] | None = None) -> list[dict]:
        shared = self.plan.bridge.shared if self.plan.bridge is not None else 0
        out = []
        for b, part in zip(batches, items):
            got = self.client.scores([(it.teacher_prompt, it.teacher_completion) for it in part])
            real, n = got["token_lp"].shape[0], b["t_rows"].shape[0]
            got = {k: np.concatenate([v, np.zeros((n - real, *v.shape[1:]), v.dtype)])
                   for k, v in got.items()}
            got["topk_lp"][real:] = -np.inf
            out.append(scoring.finish(jax.tree.map(jnp.asarray, got),
                                      jax.tree.map(jnp.asarray, b), self.plan.loss, shared,
                                      self.plan.to_student))
        return out
