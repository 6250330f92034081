"""Watching a run: experiment trackers, XLA profile windows, device memory, timers, progress.

What the training loop calls (all built from the resolved config):

    observers = Observers.from_config(cfg, run_dir, is_main_process, resume=...)
    window = ProfileWindow.from_config(cfg, run_dir, process_index, first_step=...)
    memory = MemoryProfile.from_config(cfg, run_dir, process_index)
    report = MemoryReport.from_config(cfg)
    timers, stragglers = Timers.from_config(cfg), Stragglers.from_config(cfg)
    progress_log = ProgressLog.from_config(cfg, run_dir, num_devices, is_main_process)
    health = Health.from_config(cfg, model_cfg, train_config, layout)  # pgs health/*
"""
from jaxtrain.observe.health import Health
from jaxtrain.observe.memory import MemoryProfile, MemoryReport, device_memory_stats
from jaxtrain.observe.profiler import ProfileWindow
from jaxtrain.observe.progress import Progress, ProgressLog, format_duration, progress
from jaxtrain.observe.timers import Stragglers, Timers
from jaxtrain.observe.trackers import Observers, check_trackers, enabled_trackers

__all__ = ["Health", "MemoryProfile", "MemoryReport", "Observers", "ProfileWindow", "Progress",
           "ProgressLog", "Stragglers", "Timers", "check_trackers", "device_memory_stats",
           "enabled_trackers", "format_duration", "progress"]
