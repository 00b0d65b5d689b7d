"""What a run reports: a tqdm bar, ``DIR/metrics.jsonl`` (one JSON object per step), TensorBoard events.

Only process 0 writes. A resumed run appends to the same files; when steps repeat (a run killed after
its last checkpoint), the later line for a step is the one that counts.

Throughput: ``tokens_per_s`` is global tokens over the step's wall time; ``tflops_per_device`` uses the
model's FLOPs per token (``DenseConfig.flops_per_token``: 6 per matmul weight plus causal attention, no
remat recompute) over the devices; ``mfu`` divides that by the accelerator's dense bf16 peak and
appears only when the peak is known (table below).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

# Dense bf16 peak FLOP/s per chip, from the vendors' data sheets (without sparsity).
PEAK_BF16_FLOPS = {
    "h100": 989e12,  # NVIDIA H100 SXM data sheet: 989 TFLOPS bf16 dense
    "h200": 989e12,  # NVIDIA H200 data sheet: same compute as H100 SXM
    "b200": 2250e12,  # NVIDIA DGX B200 / HGX B200: 2.25 PFLOPS bf16 dense per GPU
    "v5e": 197e12,  # Google Cloud TPU v5e: 197 TFLOPS bf16
    "v5p": 459e12,  # Google Cloud TPU v5p: 459 TFLOPS bf16
    "v6e": 918e12,  # Google Cloud TPU v6e (Trillium): 918 TFLOPS bf16
}
# How jax spells device kinds (``jax.devices()[0].device_kind``) for the chips above.
_KIND_ALIASES = {
    "tpu v5 lite": "v5e",
    "tpu v5e": "v5e",
    "tpu v5p": "v5p",
    "tpu v5": "v5p",
    "tpu v6 lite": "v6e",
    "tpu v6e": "v6e",
}


def peak_flops(device_kind: str, /) -> float | None:
    """Peak bf16 FLOP/s of one device of this kind, or None if we do not know it (e.g. CPU)."""
    kind = device_kind.lower()
    for alias, name in sorted(_KIND_ALIASES.items(), key=lambda kv: -len(kv[0])):
        if kind.startswith(alias):
            return PEAK_BF16_FLOPS[name]
    for name in ("h100", "h200", "b200"):
        if name in kind:
            return PEAK_BF16_FLOPS[name]
    return None


def throughput(
    *, tokens: int, seconds: float, flops_per_token: float, num_devices: int, device_kind: str
) -> dict[str, float]:
    """tokens/s, TFLOP/s per device and (when the peak is known) MFU of one step."""
    tokens_per_s = tokens / seconds
    flops = flops_per_token * tokens_per_s / num_devices
    out = {"tokens_per_s": tokens_per_s, "tflops_per_device": flops / 1e12}
    peak = peak_flops(device_kind)
    if peak:
        out["mfu"] = flops / peak
    return out


class MetricsLog:
    """Writes step records; a no-op on processes other than 0."""

    def __init__(
        self, out_dir: Path, /, *, enabled: bool, total_steps: int, start_step: int, tensorboard: bool, progress: bool
    ):
        self.enabled = enabled
        self._jsonl = self._tb = self._bar = None
        if not enabled:
            return
        self._jsonl = open(out_dir / "metrics.jsonl", "a", encoding="utf-8")
        if tensorboard:
            from tensorboardX import SummaryWriter  # deferred: only when TensorBoard logs are asked for

            self._tb = SummaryWriter(str(out_dir / "tensorboard"))
        if progress:
            from tqdm.auto import tqdm  # deferred: only when a progress bar is asked for

            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def write(self, record: dict, /) -> None:
        if not self.enabled:
            return
        record = {k: (round(v, 7) if isinstance(v, float) and math.isfinite(v) else v) for k, v in record.items()}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        step = record["step"]
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)
        if self._bar is not None:
            post = {
                "loss": f"{record['loss']:.4f}",
                "tok/s": f"{record.get('tokens_per_s', 0):,.0f}",
                "step_s": f"{record.get('step_time_s', 0):.3f}",
            }
            if "eval_loss" in record:
                post["eval"] = f"{record['eval_loss']:.4f}"
            self._bar.set_postfix(post, refresh=False)
            self._bar.update(step - self._bar.n)

    def message(self, text: str, /) -> None:
        """A line for the user (above the bar when there is one)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()
