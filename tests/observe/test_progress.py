"""The console: progress lines with ETA, the training line, progress.txt."""
import io
import json
import logging

from observe_helpers import make_row

from jaxtrain.metrics import MetricsLog
from jaxtrain.observe import Progress, ProgressLog, format_duration, progress


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_format_duration():
    assert [format_duration(s) for s in (5, 65, 3600 * 3 + 7 * 60 + 5)] == [
        "5s", "1m05s", "3h07m"]


def test_progress_line_has_count_rate_eta_and_fields():
    clock, out = _Clock(), io.StringIO()
    bar = Progress(100, "train", unit="step", stream=out, min_interval_s=0, clock=clock)
    clock.now = 30.0  # the first update (a compiling step) only starts the rate
    bar.update(1)
    assert "ETA ?" in out.getvalue()
    clock.now = 40.0
    bar.update(11, **{"tok/s": 4096.0, "MFU": "41.0%"})
    line = out.getvalue().splitlines()[-1]
    assert line == ("train 11/100 (11%) | 1.00 step/s | elapsed 40s | ETA 1m29s | "
                    "tok/s 4096 | MFU 41.0%")


def test_progress_throttles_plain_streams_and_redraws_terminals():
    clock, out = _Clock(), io.StringIO()
    bar = Progress(10, "docs", stream=out, min_interval_s=5, clock=clock)
    for i in range(1, 10):
        clock.now = float(i)
        bar.update(i)
    assert [ln.split(" | ")[0] for ln in out.getvalue().splitlines()] == ["docs 1/10 (10%)",
                                                                          "docs 6/10 (60%)"]
    bar.update(10)
    assert out.getvalue().splitlines()[-1].startswith("docs 10/10 (100%)")
    tty = _Tty()
    list(progress(range(3), desc="import", stream=tty, min_interval_s=0))
    assert tty.getvalue().count("\r\x1b[2K") == 4 and tty.getvalue().endswith("\n")
    assert "import 3/3 (100%)" in tty.getvalue()


def test_training_line_shows_step_total_eta_tokens_and_mfu(tmp_path, caplog):
    log = MetricsLog(tmp_path, logging.getLogger("jaxtrain.test.console"), 10)
    clock = _Clock()
    log.rate.clock = clock
    with caplog.at_level(logging.INFO, "jaxtrain.test.console"):
        clock.now = 100.0  # step 1 compiled for 100 s: the ETA must not count that
        log.write(make_row(1))
        clock.now = 102.0
        log.write(make_row(2))
    line = caplog.records[-1].getMessage()
    assert line.startswith("step 2/10 | loss 2.0000")
    for part in ("4096 tok/s (avg 4096)", "MFU 40.0%", "grad_norm 1.500", "ETA 16s"):
        assert part in line, part


def test_log_grad_norm_off_leaves_it_out(cfg, tmp_path, caplog):
    for value in ("true", "false"):
        directory = tmp_path / value
        log = MetricsLog.from_config(cfg(f"--logging.log_grad_norm={value}"), directory,
                                     logging.getLogger("jaxtrain.test.gn"), 5)
        with caplog.at_level(logging.INFO, "jaxtrain.test.gn"):
            log.write(make_row(1))
        row = json.loads((directory / "metrics.jsonl").read_text())
        assert ("grad_norm" in row) is (value == "true")
        assert ("grad_norm" in caplog.records[-1].getMessage()) is (value == "true")


def test_device_memory_fields_in_the_line(tmp_path, caplog):
    log = MetricsLog(tmp_path, logging.getLogger("jaxtrain.test.mem"), None)
    with caplog.at_level(logging.INFO, "jaxtrain.test.mem"):
        log.write(make_row(1, mem_bytes_in_use=2 ** 30, mem_peak_bytes_in_use=2 ** 31))
    assert "device mem 1.00/2.00 GiB (used/peak)" in caplog.text


def test_progress_txt(cfg, tmp_path):
    off = ProgressLog.from_config(cfg(), tmp_path / "off", num_devices=8)
    off.job_start(0)
    assert not (tmp_path / "off").exists()
    clock = _Clock()
    log = ProgressLog.from_config(cfg("log_progress=true"), tmp_path, num_devices=2)
    log.clock = clock
    log.job_start(0)
    clock.now = 10.0
    log.checkpoint(100, tokens_so_far=2e9, flops_so_far=4e15)
    log.job_end(120, tokens_so_far=2.4e9, flops_so_far=4.8e15)
    lines = (tmp_path / "progress.txt").read_text().splitlines()
    assert [ln.split("\t")[3] for ln in lines] == ["Starting job", "Saved checkpoint",
                                                   "Job finished"]
    assert "# devices: 2" in lines[0]
    assert ("Iteration: 100\tJob throughput: 200.000 TFLOP/s/device\tFloating-point operations: "
            "4.00e+15\tTokens (in billions): 2.000000") in lines[1]
    assert not ProgressLog.from_config(cfg("log_progress=true"), tmp_path / "p1", 2,
                                       is_main_process=False).path
