"""Run tracking: Weights & Biases (offline unless a key or `mode=online` says otherwise) + JSONL files.

What: `Tracker` logs scalar metrics, sample tables, images and artifacts to a W&B run under the run
directory and mirrors metrics and samples to `run_dir/metrics.jsonl` / `samples.jsonl`;
`plot_rewards` redraws the reward curve from metrics.jsonl; `read_wandb_offline` parses offline
`.wandb` files back into history, config and summary. Why: a run must never fail or hang because W&B
is unreachable, and tests and scripts read the JSONL mirror without W&B.

Invariants: `wandb` is imported lazily (`tracking.mode=disabled` never touches it); online falls back
to offline with a warning; offline never opens a connection; `run_id` is stored in checkpoints, so a
resumed run continues the same W&B run, and `resume_step` drops JSONL lines logged after the
checkpoint (the files equal an uninterrupted run's).
"""

from __future__ import annotations

import json
import logging
import netrc
import os
import re
import secrets
import socket
import string
import struct
import time
import zlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from rl.config_sections import TrackingSection

# Offline files: run_dir/wandb/offline-run-*/run-<id>.wandb (`wandb sync` uploads them later).
# `.wandb` format (wandb 0.31, written by wandb-core): a 7-byte header `:W&B` + magic 0xBEE1 (u16 LE)
# + version 0 (u8), then the LevelDB log format over 32 KiB blocks counted from the start of the
# file: each fragment has a 7-byte header crc32 (4, LE; zlib CRC-32 of the type byte + payload),
# length (2, LE), type (1: FULL, FIRST, MIDDLE, LAST); a block tail shorter than a header is zero
# padding. Reassembled payloads are `wandb.proto.wandb_internal_pb2.Record` messages.

log = logging.getLogger(__name__)

_ID_CHARS = string.ascii_lowercase + string.digits
_HOST_PROBE_TIMEOUT_S = 3.0  # a reachable W&B answers a TCP connect well within this
_FINISH_WAIT_S = 30.0  # wandb-core flushes the run file within milliseconds; this bounds a stall


def new_run_id() -> str:
    """8 base-36 characters, W&B's own run-id shape."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(8))


def _wandb_host() -> str:
    return urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"


def _have_credentials() -> bool:
    """WANDB_API_KEY or a `wandb login` netrc entry: without either, wandb.init online would prompt."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(_wandb_host()) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _wandb_reachable() -> bool:
    url = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "api.wandb.ai", port), timeout=_HOST_PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


def _truncate_jsonl(path: Path, max_step: int) -> None:
    """Keep only the lines with step <= max_step (a resumed run re-logs everything after it)."""
    if not path.exists():
        return
    kept = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= max_step]
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(f"{ln}\n" for ln in kept))
    os.replace(tmp, path)


class Tracker:
    """One run's tracking. `config_dict` is the resolved config (rl.config.config_to_dict)."""

    def __init__(
        self,
        cfg: TrackingSection,
        run_dir: str | Path,
        config_dict: Mapping[str, Any],
        resume_run_id: str | None = None,
        resume_step: int | None = None,
    ):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.samples_path = self.run_dir / "samples.jsonl"
        self.plot_path = self.run_dir / "plots" / "reward.png"
        if resume_step is not None:
            _truncate_jsonl(self.metrics_path, resume_step)
            _truncate_jsonl(self.samples_path, resume_step)
        self._metrics_f = self.metrics_path.open("a")
        self._samples_f = self.samples_path.open("a")
        self._run_id = resume_run_id or new_run_id()
        self.mode = cfg.resolved_mode()
        self._wandb: Any = None
        self._run: Any = None
        if self.mode != "disabled":
            self._start_wandb(dict(config_dict), resume=resume_run_id is not None)

    # ------------------------------------------------------------------------------ W&B start-up
    def _start_wandb(self, config: dict[str, Any], resume: bool) -> None:
        import wandb  # lazy: heavy, and not needed when tracking is disabled

        self._wandb = wandb
        if self.mode == "online" and not _have_credentials():
            log.warning("W&B online requested but no WANDB_API_KEY / `wandb login`: logging offline instead")
            self.mode = "offline"
        if self.mode == "online" and not _wandb_reachable():
            log.warning("W&B host unreachable: logging offline instead (upload later with `wandb sync`)")
            self.mode = "offline"
        try:
            self._run = self._init(config, resume)
        except Exception as e:  # any W&B failure (auth, network, server) must not stop training
            if self.mode != "online":
                raise
            log.warning("wandb.init online failed (%s): logging offline instead", e)
            self.mode = "offline"
            self._run = self._init(config, resume)
        log.info("W&B run %s (%s) under %s", self._run_id, self.mode, self.run_dir / "wandb")

    def _init(self, config: dict[str, Any], resume: bool) -> Any:
        wandb = self._wandb
        settings = wandb.Settings(silent=True, init_timeout=60, disable_git=True, save_code=False)
        return wandb.init(
            project=self.cfg.project,
            entity=self.cfg.entity,
            name=self.cfg.run_name,
            tags=list(self.cfg.tags) or None,
            config=config,
            id=self._run_id,
            resume="allow" if resume else None,
            dir=str(self.run_dir),
            mode=self.mode,
            settings=settings,
            reinit="create_new",  # several Trackers in one process (tests, sweeps) stay separate
        )

    # ------------------------------------------------------------------------------ logging
    @property
    def run_id(self) -> str:
        return self._run_id

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Scalars at `step` (several calls at one step merge into one W&B row)."""
        row = {k: float(v) for k, v in metrics.items()}
        self._metrics_f.write(json.dumps({"step": int(step), **row}) + "\n")
        self._metrics_f.flush()
        if self._run is not None:
            self._run.log(row, step=int(step))

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Up to `log_samples` rows with keys prompt, completion, reward (extra keys kept too)."""
        rows = list(rows)[: self.cfg.log_samples]
        if not rows:
            return
        for r in rows:
            self._samples_f.write(json.dumps({"step": int(step), **r}, default=str) + "\n")
        self._samples_f.flush()
        if self._run is not None:
            columns = ["step", "prompt", "completion", "reward"]
            columns += sorted({k for r in rows for k in r} - set(columns))
            data = [[step] + [r.get(c) for c in columns[1:]] for r in rows]
            self._run.log({"samples": self._wandb.Table(columns=columns, data=data)}, step=int(step))

    def log_image(self, step: int, key: str, path: str | Path) -> None:
        if self._run is not None:
            self._run.log({key: self._wandb.Image(str(path))}, step=int(step))

    def log_artifact(self, path: str | Path, name: str, type: str) -> None:
        """A file or a directory (e.g. the exported adapter) as a W&B artifact."""
        if self._run is None:
            return
        art = self._wandb.Artifact(name, type=type)
        path = Path(path)
        if path.is_dir():
            art.add_dir(str(path))
        else:
            art.add_file(str(path))
        self._run.log_artifact(art)

    def update_summary(self, values: Mapping[str, Any]) -> None:
        if self._run is not None:
            for k, v in values.items():
                self._run.summary[k] = v

    def update_plot(self, step: int | None = None) -> Path:
        """Redraw plots/reward.png from metrics.jsonl; with `step`, also log it to W&B."""
        plot_rewards(self.metrics_path, self.plot_path)
        if step is not None:
            self.log_image(step, "plots/reward", self.plot_path)
        return self.plot_path

    def finish(self) -> None:
        """Close the run. Returns once the `.wandb` file holds its exit record: wandb-core writes it
        from another process and may still be flushing when `run.finish()` returns."""
        if self._run is not None:
            sync_file = Path(self._run.settings.sync_file)
            self._run.finish()
            self._run = None
            if self.mode == "offline" and not _wait_for_exit_record(sync_file, _FINISH_WAIT_S):
                log.warning("W&B run file %s still incomplete after %.0f s", sync_file, _FINISH_WAIT_S)
        for f in (self._metrics_f, self._samples_f):
            if not f.closed:
                f.close()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()


# ---------------------------------------------------------------------------------------- plots
def read_metrics(metrics_jsonl: str | Path) -> list[dict[str, float]]:
    path = Path(metrics_jsonl)
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def plot_rewards(metrics_jsonl: str | Path, out_png: str | Path) -> Path:
    """reward/mean and acc/mean per step as lines, eval/acc as points; atomic replace of out_png."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # no pyplot: no global state, safe off the main thread

    rows = read_metrics(metrics_jsonl)
    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    curves = (("reward/mean", "-"), ("acc/mean", "-"), ("eval/acc", "o--"), ("eval/tool_call_success", "s:"))
    for key, style in curves:  # a curve is drawn only if the run logs it (tool success: multi-turn runs)
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=key, markersize=5)
    ax.set_xlabel("step")
    ax.set_ylabel("reward / accuracy")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best")
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.stem}.tmp.png")
    fig.savefig(tmp)
    os.replace(tmp, out)  # a reader (W&B, a browser) never sees a half-written PNG
    return out


# ------------------------------------------------------------------------------ .wandb reader
_BLOCK = 32 * 1024
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
_FILE_MAGIC = b":W&B" + struct.pack("<H", 0xBEE1)


def _iter_payloads(path: Path) -> Iterator[bytes]:
    """Reassembled record payloads; stops quietly at a truncated tail (a run still writing)."""
    data = path.read_bytes()
    if data[:6] != _FILE_MAGIC:
        raise ValueError(f"{path}: not a W&B run file (header {data[:7]!r})")
    pos, parts = _HEADER, []
    while pos + _HEADER <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _HEADER:  # zero padding at a block's end
            pos += left_in_block
            continue
        crc, length, kind = struct.unpack_from("<IHB", data, pos)
        if kind == 0 and length == 0:  # zero-filled rest of the block
            pos += left_in_block
            continue
        body = data[pos + _HEADER : pos + _HEADER + length]
        if len(body) < length:
            return
        if zlib.crc32(bytes([kind]) + body) != crc:
            raise ValueError(f"{path}: checksum mismatch in the record at byte {pos}: the file is corrupted")
        pos += _HEADER + length
        if kind == _FULL:
            yield body
        elif kind == _FIRST:
            parts = [body]
        elif kind == _MIDDLE:
            parts.append(body)
        elif kind == _LAST:
            yield b"".join([*parts, body])
            parts = []
        else:
            raise ValueError(f"{path}: unknown fragment type {kind} at byte {pos}")


def _wait_for_exit_record(path: Path, timeout_s: float) -> bool:
    from wandb.proto import wandb_internal_pb2 as pb

    deadline = time.monotonic() + timeout_s
    while True:
        if path.is_file():
            for payload in _iter_payloads(path):
                rec = pb.Record()
                rec.ParseFromString(payload)
                if rec.WhichOneof("record_type") == "exit":
                    return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def _set_item(target: dict[str, Any], item: Any) -> None:
    keys = list(item.nested_key) or [item.key]
    node = target
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    node[keys[-1]] = json.loads(item.value_json)


def read_wandb_file(path: str | Path) -> dict[str, Any]:
    """One `.wandb` file -> {path, run_id, project, name, config, summary, history, exit_code}.
    `history` rows are dicts keyed as logged (`reward/mean`, `_step`, ...); nested keys (a table's
    metadata) become nested dicts."""
    from wandb.proto import wandb_internal_pb2 as pb

    path = Path(path)
    out: dict[str, Any] = {"path": str(path), "run_id": None, "project": None, "name": None}
    out.update(config={}, summary={}, history=[], exit_code=None)
    for payload in _iter_payloads(path):
        rec = pb.Record()
        rec.ParseFromString(payload)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out.update(run_id=rec.run.run_id, project=rec.run.project, name=rec.run.display_name or None)
            for item in rec.run.config.update:
                _set_item(out["config"], item)
        elif kind == "config":
            for item in rec.config.update:
                _set_item(out["config"], item)
        elif kind == "history":
            row: dict[str, Any] = {}
            for item in rec.history.item:
                _set_item(row, item)
            out["history"].append(row)
        elif kind == "summary":
            for item in rec.summary.update:
                _set_item(out["summary"], item)
        elif kind == "exit":
            out["exit_code"] = rec.exit.exit_code
    out["config"].pop("_wandb", None)
    return out


def read_wandb_offline(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every W&B run file under `run_dir/wandb/`, oldest first (a resumed run adds one file per
    resume, same run_id), each parsed by `read_wandb_file`."""
    files = Path(run_dir).glob("wandb/*run-*/run-*.wandb")
    # directory names: [offline-]run-YYYYmmdd_HHMMSS-<id>; order by the timestamp, then the name
    return [read_wandb_file(f) for f in sorted(files, key=lambda p: (_stamp(p.parent.name), p.parent.name))]


def _stamp(dirname: str) -> str:
    m = re.search(r"\d{8}_\d{6}", dirname)
    return m.group(0) if m else ""
