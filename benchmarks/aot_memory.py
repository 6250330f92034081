"""Ahead-of-time memory check: compile the train step for N devices without the hardware.

    python benchmarks/aot_memory.py CONFIG --devices N [key=value ...] [--json OUT]

N fake CPU devices stand in for the target topology. The real train step (same mesh, logical-
axis table, shardings and donation as a run) is lowered from *abstract* state, so nothing the
size of the model is allocated, and compiled; XLA's memory analysis of the partitioned program
then gives per-device bytes:

- ``state``: parameters + optimizer state held by one device (exact: the shard shapes);
- ``arguments`` / ``outputs``: the step's inputs and results per device (state + batch);
- ``temporaries``: XLA's scratch for activations and gradients. This is the CPU compiler's
  figure; a GPU compile fuses and schedules differently, so read it as an estimate;
- ``peak``: arguments + outputs - aliased (donated) + temporaries.

Only the first batch is read from the data, to get its shapes.

``--gradient-release`` compiles the step twice, with ``memory.gradient_release`` false and
true (pgs's optimizer-in-the-backward, jaxtrain/release.py), and prints both side by side.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys


def _shard_bytes(tree) -> int:
    import jax

    return sum(math.prod(s.sharding.shard_shape(s.shape)) * s.dtype.itemsize
               for s in jax.tree.leaves(tree))


def compile_step(config: str | None, overrides: list[str], devices: int):
    """(run, abstract state, compiled train step) for ``devices`` devices, lowered from
    abstract state (nothing the size of the model is allocated)."""
    import jax

    from jaxtrain import loop
    from jaxtrain.config import load_config
    from jaxtrain.data.batches import global_batches

    cfg = load_config(config, overrides, world_size=devices)
    run = loop.build(cfg, jax.devices()[:devices], materialize=False)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         run.abstract, run.shardings)
    host = next(global_batches(run.data, run.tcfg, seed=0))
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=run.layout.batch())
             for k, v in host.items()}
    return run, state, run.step_fn.lower(state, batch).compile()


def analyse(config: str | None, overrides: list[str], devices: int) -> dict:
    """Per-device memory of the compiled train step for ``devices`` devices."""
    import jax

    run, state, compiled = compile_step(config, overrides, devices)
    stats = compiled.memory_analysis()
    gib = 2.0 ** 30
    return {
        "devices": devices,
        "mesh": {k: v for k, v in run.layout.mesh.shape.items() if v > 1},
        "sharding": run.layout.mcfg.sharding,
        "parameters": sum(x.size for x in jax.tree.leaves(run.abstract.params)),
        "state_gib": _shard_bytes(state) / gib,
        "params_gib": _shard_bytes(state.params) / gib,
        "opt_state_gib": _shard_bytes(state.opt_state) / gib,
        "arguments_gib": stats.argument_size_in_bytes / gib,
        "outputs_gib": stats.output_size_in_bytes / gib,
        "temporaries_gib": stats.temp_size_in_bytes / gib,
        "aliased_gib": stats.alias_size_in_bytes / gib,
        # live at once at worst: inputs, results not written over donated inputs, scratch
        "peak_gib": (stats.argument_size_in_bytes + stats.output_size_in_bytes
                     - stats.alias_size_in_bytes + stats.temp_size_in_bytes) / gib,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", help="config file (any dialect); 'none' for defaults only")
    parser.add_argument("--devices", type=int, required=True, help="target device count")
    parser.add_argument("--json", help="also write the result to this JSON file")
    parser.add_argument("--gradient-release", action="store_true",
                        help="compare the step without and with memory.gradient_release")
    args, overrides = parser.parse_known_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    from jaxtrain.config import ConfigError

    config = None if args.config == "none" else args.config
    modes = ({"off": ["memory.gradient_release=false"], "on": ["memory.gradient_release=true"]}
             if args.gradient_release else {"": []})
    try:
        runs = {mode: analyse(config, overrides + extra, args.devices)
                for mode, extra in modes.items()}
    except ConfigError as e:
        print(f"aot_memory: config error: {e}", file=sys.stderr)
        return 2

    def shown(value):
        return f"{value:.4f}" if isinstance(value, float) else str(value)

    first = next(iter(runs.values()))
    width = max(map(len, first))
    if args.gradient_release:
        print(f"{'memory.gradient_release':<{width}}  {'false':>12}  {'true':>12}")
    for key in first:
        print(f"{key:<{width}}  " + "  ".join(f"{shown(r[key]):>12}" for r in runs.values()))
    got = runs if args.gradient_release else first
    if args.json:
        with open(args.json, "w") as f:
            json.dump(got, f, indent=1)
    return 0


if __name__ == "__main__":
    from jaxtrain import cli

    sys.exit(cli.run(main))
