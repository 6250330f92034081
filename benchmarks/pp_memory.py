"""Pipeline schedules compiled: device memory of the executor's step per schedule.

    python benchmarks/pp_memory.py [--ranks 4] [--microbatches 4,8,16] [--seq 256]

On ``ranks`` fake CPU devices (one per pipeline rank), compiles the pipelined gradient
computation (jaxtrain.parallel.pipeline.accumulate) of a small Llama-like model for each
schedule and microbatch count, and prints XLA's temporary-buffer size per device
(``memory_analysis().temp_size_in_bytes``) beside the stage inputs the lowered program keeps
(slots). GPipe's memory grows with the microbatches; 1F1B's and the zero-bubble schedules'
does not. One slot is one microbatch's [b, T, D] stage input (float32 here).
"""
from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--microbatches", default="4,8,16")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=256)
    args = ap.parse_args(argv)
    p = args.ranks
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", p)
    import jax.numpy as jnp

    from jaxtrain import models
    from jaxtrain.parallel import pipeline, schedules, stages
    from jaxtrain.parallel.mesh import MeshConfig, make_mesh
    from jaxtrain.parallel.sharding import Layout

    D, T, B = args.hidden, args.seq, 2
    cfg = models.ModelConfig(num_layers=2 * p, hidden_size=D, num_attention_heads=4,
                             ffn_hidden_size=2 * D, vocab_size=256, max_position_embeddings=T)
    params = models.init(cfg, jax.random.key(0))
    mcfg = MeshConfig(pipeline=p)
    layout = Layout(make_mesh(mcfg, jax.devices()[:p]), mcfg)
    slot_mib = B * T * D * 4 / 2**20
    print(f"{p} ranks, {2 * p} layers, D={D}, T={T}, b={B}: one slot = {slot_mib:.2f} MiB")
    print(f"{'schedule':<18}{'m':>4}{'slots':>7}{'ticks':>7}{'temp MiB':>10}")
    for name in schedules.SCHEDULES:
        v = 2 if name in ("1f1b-interleaved", "zbv") else 1
        for m in (int(x) for x in args.microbatches.split(",")):
            try:
                sched = schedules.build(name, p, m, v)
            except ValueError as e:
                print(f"{name:<18}{m:>4}  {e}")
                continue
            bounds = stages.bounds(stages.stage_layers({}, cfg.num_layers, p, v))
            prog = pipeline.lower(sched, cfg, bounds)
            batch = {"tokens": jnp.zeros((m, B, T), jnp.int32),
                     "targets": jnp.zeros((m, B, T), jnp.int32)}
            w = jnp.ones((m, B, T), jnp.float32)

            def grads(params, batch, w, prog=prog):
                sp, shared = pipeline.split_params(params, cfg, prog.schedule, prog.bounds)
                with layout.activations():
                    return pipeline.accumulate(
                        prog, layout, cfg, stacks=sp, shared=shared, batch=batch,
                        weights_MBT=w, step_rng=jax.random.key(0), scale=1.0, num_chunks=1,
                        half_precision=False, accum_dtype=jnp.float32)[:3]

            compiled = jax.jit(grads).lower(params, batch, w).compile()
            temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
            print(f"{name:<18}{m:>4}{prog.x_slots:>7}{prog.ticks:>7}{temp:>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
