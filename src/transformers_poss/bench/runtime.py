"""Measurement helpers for `poss bench`: device sync, peak memory while a method runs, and the environment record."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import resource
import threading
import time

import torch


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued GPU work so wall-clock timings are honest (no-op on CPU)."""
    if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(device)


def _rss_mb() -> float | None:
    """Resident set size of this process in MiB (Linux /proc), None where unavailable."""
    try:
        with open("/proc/self/statm") as handle:
            resident_pages = int(handle.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20


class PeakMemory:
    """Context manager measuring peak memory while a block runs.

    On CUDA it reads ``torch.cuda.max_memory_allocated``; on CPU a background thread samples the process resident
    set size every `interval` seconds (falling back to the process-lifetime maximum from ``getrusage``).
    After the block: ``peak_mb`` (peak during the block) and ``delta_mb`` (peak minus the level at entry).
    """

    def __init__(self, device: torch.device | str | None = None, interval: float = 0.01):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.interval = interval
        self.peak_mb: float | None = None
        self.delta_mb: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_mb: float | None = None

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            current = _rss_mb()
            if current is not None and (self.peak_mb is None or current > self.peak_mb):
                self.peak_mb = current

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start_mb = torch.cuda.memory_allocated(self.device) / 2**20
            return self
        self._start_mb = _rss_mb()
        self.peak_mb = self._start_mb
        if self._start_mb is not None:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda" and torch.cuda.is_available():
            self.peak_mb = torch.cuda.max_memory_allocated(self.device) / 2**20
        elif self._thread is not None:
            self._stop.set()
            self._thread.join()
            current = _rss_mb()
            if current is not None:
                self.peak_mb = max(self.peak_mb or current, current)
        else:
            self.peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        if self._start_mb is not None and self.peak_mb is not None:
            self.delta_mb = max(self.peak_mb - self._start_mb, 0.0)


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_name() -> str:
    """CPU model name from /proc/cpuinfo, else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: torch.device | str | None = None) -> dict:
    """Versions, hardware and threading, for the report's ``environment`` section."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {name: _version(name) for name in
                     ("transformers-poss", "torch", "transformers", "tokenizers", "safetensors", "gguf")},
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "cpu_capability": getattr(torch.backends.cpu, "get_cpu_capability", lambda: None)(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "gpu": None,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if device.type == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    return env
