"""Readers for what the trackers wrote, and a metrics row like the loop's."""
import glob
import json
import struct


def make_row(step: int, **extra) -> dict:
    """A metrics row like the loop's."""
    row = {"step": step, "loss": 4.0 / step, "grad_norm": 1.5, "lr": 1e-3 * step,
           "loss_scale": 1024.0, "global_batch_size": 8, "step_time_s": 0.25,
           "tokens_per_s": 4096.0, "tflops_per_device": 1.0, "mfu": 0.4, "memory_gib": None,
           "step_time_avg_s": 0.25, "tokens_per_s_avg": 4096.0}
    row.update(extra)
    return row


def tb_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] read with TensorBoard's own event reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}


def wandb_records(save_dir):
    """The protobuf records of every offline W&B run under ``save_dir`` (the .wandb file is a
    LevelDB-style log: 7-byte header, then 32 KiB blocks of checksum/length/type chunks).
    ``run.finish()`` may return before W&B's service has written the file; ``teardown`` waits."""
    import wandb
    from wandb.proto import wandb_internal_pb2 as pb

    wandb.teardown()

    out = []
    for path in sorted(glob.glob(f"{save_dir}/wandb/offline-run-*/run-*.wandb")):
        with open(path, "rb") as f:
            raw, pos, block, buf = f.read(), 7, 32768, b""
        assert raw[:4] == b":W&B"
        while pos + 7 <= len(raw):
            if block - pos % block < 7:
                pos += block - pos % block
                continue
            length, kind = struct.unpack("<HB", raw[pos + 4:pos + 7])
            if length == 0 and kind == 0:
                pos += block - pos % block
                continue
            buf += raw[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # a whole record, or the last chunk of one
                record = pb.Record()
                record.ParseFromString(buf)
                out.append(record)
                buf = b""
    return out


def wandb_history(save_dir) -> dict[int, dict[str, float]]:
    """step -> logged metrics from the offline run files."""
    steps = {}
    for record in wandb_records(save_dir):
        if record.WhichOneof("record_type") == "history":
            items = {name: json.loads(i.value_json) for i in record.history.item
                     if not (name := i.key or "/".join(i.nested_key)).startswith("_")}
            steps.setdefault(record.history.step.num, {}).update(items)
    return steps


def wandb_runs(save_dir):
    return [r.run for r in wandb_records(save_dir) if r.WhichOneof("record_type") == "run"]
